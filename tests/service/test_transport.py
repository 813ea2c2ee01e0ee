"""`HttpGuard` (service/transport.py) without sockets: the bound, and who is evicted to make room.
The deadlines themselves run against a real server in tests/hostile/test_connections.py."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
import pytest

from uvicorn.protocols.http.h11_impl import H11Protocol

from service.transport import HttpGuard
from websockets.exceptions import ConnectionClosed


class _Conn:  # stands in for a GuardedH11Protocol
    def __init__(self) -> None:
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def _guard(limit: int) -> HttpGuard:
    return HttpGuard(timeout_headers=10, timeout_body=30, timeout_send=30, max_connections=limit)


def test_at_the_bound_the_longest_waiting_connection_is_evicted() -> None:
    guard = _guard(3)
    a, b, c, d, e = conns = [_Conn() for _ in range(5)]
    g: Any = guard  # the guard's type hints name the real protocol
    for conn in (a, b, c):
        assert g.admit(conn)
    g.enter(a, "busy")  # running a request: never evicted
    g.enter(b, "body")  # waiting on its client from now on: behind c
    assert g.admit(d) and c.evicted and not b.evicted and len(guard) == 3
    assert g.admit(e) and b.evicted and not a.evicted
    assert [x.evicted for x in conns] == [False, True, True, False, False]
    g.enter(e, "busy")
    g.enter(d, "send")  # a response its client does not read: waiting on its client too
    g.enter(a, "body")
    f = _Conn()
    assert g.admit(f) and d.evicted and not a.evicted and not e.evicted


def test_when_every_connection_runs_a_request_a_new_one_is_refused() -> None:
    guard = _guard(2)
    a, b, c = (_Conn() for _ in range(3))
    g: Any = guard
    for conn in (a, b):
        g.admit(conn)
        g.enter(conn, "busy")
    assert not g.admit(c) and len(guard) == 2 and not a.evicted and not b.evicted
    g.leave(a)
    assert g.admit(c) and len(guard) == 2


def test_the_protocol_class_is_bound_to_its_guard() -> None:
    guard = _guard(1)
    protocol = guard.protocol()
    assert issubclass(protocol, H11Protocol) and protocol.guard is guard
    assert _guard(1).protocol().guard is not guard


def test_an_http_peer_budget_is_its_client_an_internet_ipv6_its_64() -> None:
    """A connection's reads and handling are charged to its peer's budget, the peer grouped as `client_key` groups
    it: another address of the same /64 finds the budget spent, another /64 does not."""
    protocol = _guard(4).protocol()

    def charge(host: str, seconds: float) -> float:
        conn: Any = object.__new__(protocol)
        conn.client = (host, 4321)
        return conn._charge(seconds)

    assert charge("2a00:1450:4001:81b::1", 1.0) > 5  # (1 s of loop time at 10%: ~10 s to refill)
    assert charge("2a00:1450:4001:81b:ffff::2", 0.0) > 5
    assert charge("2a00:1450:4001:81c::1", 0.0) == 0.0
    assert charge("::ffff:127.0.0.9", 1.0) > 5 and charge("127.0.0.9", 0.0) > 5


@pytest.mark.parametrize("upgrade", [b"", b"upgrade: x\r\n"])
def test_bytes_read_after_a_whole_request_wait_until_its_response(upgrade: bytes) -> None:
    """Once a request is whole, h11 parses nothing more until its response is complete: what is read meanwhile (a
    pipelined request, its body) stays in the backlog, to go a slice at a time, charged, when it is. With nothing
    held, reads go on (a hang-up is seen). A request with an `Upgrade` header that is no WebSocket's ends in h11's
    MIGHT_SWITCH_PROTOCOL, not DONE: its pipelined bytes went into h11 whole, to be parsed in one go."""
    conn: Any = object.__new__(_guard(4).protocol())
    conn.conn = h11.Connection(h11.SERVER)
    conn.conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n" + upgrade + b"\r\nhi")
    conn._backlog = b""
    assert conn._may_parse()
    assert [type(conn.conn.next_event()) for _ in range(3)] == [h11.Request, h11.Data, h11.EndOfMessage]
    assert conn.conn.their_state in (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL)
    assert conn._may_parse()  # (nothing held: reads go on)
    conn._backlog = b"GET / HTTP/1.1\r\n"
    assert not conn._may_parse()


async def test_a_websocket_is_charged_to_its_peer_from_its_upgrade_and_holds_nothing_once_closed(
        tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sluice's protocols in a server of this process, its budgets on a frozen clock (nothing refills). A refused
    upgrade's handling (its Origin check made to take 50 ms of the loop) is charged to its peer's budget: before, a
    new socket charged its own, a fresh burst, dropped once the app named its client, and upgrades refused cost their
    client nothing. Every socket's hold on its client's budget ends with it (accepted, refused, or never saying
    hello)."""
    import threading
    import time

    import httpx
    import uvicorn
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    import service.ws
    from service.app import build_app
    from service.budget import PeerBudgets
    from service.config import ServerConfig
    from service.transport import SluiceWebSocketProtocol
    from tests.server import free_port

    app = build_app(ServerConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, engine_process=False,
                                 api_key="k", timeout_auth=0.5))
    svc = app.state.service
    svc.loop_budgets = budgets = PeerBudgets(clock=lambda: 0.0)
    guard = HttpGuard(timeout_headers=10, timeout_body=30, timeout_send=30, max_connections=64, budgets=budgets)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=guard.protocol(),
                                           ws=SluiceWebSocketProtocol, ws_per_message_deflate=False, log_config=None))
    thread = threading.Thread(target=server.run, name="charged-upgrades", daemon=True)
    thread.start()
    url = f"ws://127.0.0.1:{port}/v1/ws"
    try:
        deadline = time.monotonic() + 180
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            while not (server.started and (await http.get("/health")).status_code == 200):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        budgets._by_peer.clear()  # (a full burst for what follows)
        # (other clients than the refused upgrade's, whose budget will not refill: their closes are read)
        accepted = await connect(url, additional_headers={"Authorization": "Bearer k"}, local_addr=("127.0.0.2", 0))
        assert json.loads(await accepted.recv())["type"] == "ready"
        silent = await connect(url, local_addr=("127.0.0.3", 0))  # (never says hello: closed at --timeout-auth)
        budgets.charge("127.0.0.1", 0.0)
        before = budgets._by_peer["127.0.0.1"].tokens

        def slow_origin_check(*args: Any) -> bool:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.05:
                pass
            return False

        monkeypatch.setattr(service.ws, "origin_allowed", slow_origin_check)
        with pytest.raises(InvalidStatus) as refused:
            await connect(url, additional_headers={"Authorization": "Bearer k"})
        assert refused.value.response.status_code == 403
        spent = before - budgets._by_peer["127.0.0.1"].tokens
        assert spent >= 0.05, f"a refused upgrade's 50 ms of handling charged its peer {spent * 1e3:.1f} ms"
        await accepted.close()
        with pytest.raises(ConnectionClosed):  # (an `unauthorized` frame, then the close)
            async with asyncio.timeout(10):
                while True:
                    await silent.recv()
        deadline = time.monotonic() + 10
        while budgets._held:  # (the server lets go a moment after each close)
            assert time.monotonic() < deadline, f"budgets still held: {budgets._held}"
            await asyncio.sleep(0.05)
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, 30)
