"""Connection's two ways out (service/ws.py): under Sluice's server a session's output is written in the call that
made it (`send_text_now`, the scope extension service/transport.py offers); what the socket turns back (a full
buffer), a close, and everything under another server go through the writer task, in order. Over a real `Service`
whose engine is never started, handles fed by hand as the bridge feeds them, and a socket that records frames
(`Wire`); the real server's side of `send_text_now` is tested against uvicorn below."""
from __future__ import annotations

import asyncio
import json

import pytest

from service.handle import RequestHandle
from service.protocol import Pong
from service.transport import SEND_TEXT_NOW
from service.ws import Connection
from service.ws_session import CONTROL_HIGH_WATER, _Chat
from tests.service.conftest import idle_service


class Wire:
    """The socket: frames in the order they went out, and how (`now` in the caller's turn, `task` by the writer).
    `take_now` False: the buffer is full (what `send_text_now` reports then); `fail_now` raises instead."""

    def __init__(self, fast: bool = True) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.take_now, self.fail_now, self.closed = True, False, None
        self.client = None  # (starlette's peer address: none)
        self.gate: asyncio.Event | None = None  # set: the writer's sends wait for it
        self.sending = False
        self.scope = {"extensions": {SEND_TEXT_NOW: self.send_text_now}} if fast else {}

    def send_text_now(self, data: bytes) -> bool:
        if self.fail_now:
            raise RuntimeError("a socket that raises")
        if self.take_now:
            self.sent.append(("now", json.loads(data)))
        return self.take_now

    async def send_text(self, text: str) -> None:
        self.sending = True
        await asyncio.sleep(0)  # a real send may yield
        if self.gate is not None:
            await self.gate.wait()
        self.sent.append(("task", json.loads(text)))
        self.sending = False

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = code

    def frames(self, chat_id: str) -> list[str]:
        return [f"{f['type']}:{f.get('text', '')}" for _, f in self.sent if f.get("id") == chat_id]


def _connection(wire: Wire) -> tuple[Connection, asyncio.Task[None]]:
    conn = Connection(wire, idle_service())  # type: ignore[arg-type]
    return conn, asyncio.get_running_loop().create_task(conn._write_loop())


def _chat(conn: Connection, chat_id: str) -> RequestHandle:
    handle = RequestHandle(f"r-{chat_id}", "ws", lambda: conn.session._mark(chat_id))
    conn.session.chats[chat_id] = _Chat(chat_id, handle)
    handle.start(5, 0, handle.arrival)
    return handle


def _step(handle: RequestHandle, text: str) -> None:
    """What `EngineBridge.on_steps` does with one step's delivery."""
    handle.push(text, 1, None)
    handle.notify()


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_output_is_written_in_the_call_that_made_it() -> None:
    wire = Wire()
    conn, writer = _connection(wire)
    h = _chat(conn, "a")
    _step(h, "Hel")
    assert wire.sent == [("now", {"type": "start", "id": "a", "prompt_tokens": 5, "cached_tokens": 0}),
                         ("now", {"type": "delta", "id": "a", "text": "Hel", "tokens": 1})]  # no await between
    _step(h, "lo")
    h.finish("stop", None)
    h.notify()
    assert wire.frames("a") == ["start:", "delta:Hel", "delta:lo", "done:"]
    assert all(how == "now" for how, _ in wire.sent) and "a" not in conn.session.chats
    writer.cancel()


async def test_a_full_buffer_hands_the_rest_to_the_writer_in_order() -> None:
    wire = Wire()
    conn, writer = _connection(wire)
    a, b = _chat(conn, "a"), _chat(conn, "b")
    _step(a, "1")
    wire.take_now = False  # the socket's buffer is over its high-water mark
    _step(a, "2")
    _step(b, "x")
    _step(a, "3")  # taken from the session while the writer still has frames to send: the writer sends it
    wire.take_now = True  # drained; but the writer has the turn until it waits again
    _step(b, "y")
    await _settle()
    assert wire.frames("a") == ["start:", "delta:1", "delta:2", "delta:3"]
    assert [x for x in wire.frames("b") if x.startswith("delta")] == ["delta:xy"]  # merged while it waited
    assert [how for how, f in wire.sent if f.get("text") in ("2", "3", "xy")] == ["task"] * 3
    _step(a, "4")  # the writer waits again: written in the caller's turn
    assert wire.sent[-1] == ("now", {"type": "delta", "id": "a", "text": "4", "tokens": 1})
    writer.cancel()


async def test_output_made_while_the_writer_sends_waits_for_it() -> None:
    wire = Wire()
    conn, writer = _connection(wire)
    h = _chat(conn, "a")
    wire.take_now, wire.gate = False, asyncio.Event()
    _step(h, "1")  # turned back: the writer's
    wire.take_now = True
    while not wire.sending:
        await asyncio.sleep(0)
    _step(h, "2")  # the writer is in the middle of a send: written now, it would overtake "1"
    wire.gate.set()
    await _settle()
    assert wire.frames("a") == ["start:", "delta:1", "delta:2"] and {how for how, _ in wire.sent} == {"task"}
    _step(h, "3")
    assert wire.sent[-1][0] == "now"
    writer.cancel()


async def test_a_socket_that_raises_closes_1011_and_the_fan_out_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    wire = Wire()
    conn, writer = _connection(wire)
    h, other = _chat(conn, "a"), _chat(conn, "b")
    wire.fail_now = True
    _step(h, "lost")  # raises inside: not out of the engine step's fan-out that called it
    _step(other, "x")
    assert "writing to a websocket failed; closing it" in caplog.text
    wire.fail_now = False
    await asyncio.wait_for(writer, 5)
    assert wire.closed == 1011 and not [f for _, f in wire.sent if f.get("text") == "lost"]


async def test_a_close_is_the_writers_after_what_is_pending() -> None:
    wire = Wire()
    conn, writer = _connection(wire)
    h = _chat(conn, "a")
    _step(h, "first")
    wire.take_now = False  # full: what is pending now is the writer's
    _step(h, "pending")
    conn.session.send(conn.session.ready())
    conn.shutdown(1001)
    wire.take_now = True
    _step(h, "after")  # made after the close began: never written at once, ahead of the pending frames
    await asyncio.wait_for(writer, 5)
    assert [(how, f["type"], f.get("text")) for how, f in wire.sent] == [
        ("now", "start", None), ("now", "delta", "first"), ("task", "delta", "pending"), ("task", "ready", None),
        ("task", "delta", "after")] and wire.closed == 1001


async def test_the_reader_pauses_until_turned_back_replies_are_sent() -> None:
    wire = Wire()
    conn, writer = _connection(wire)
    wire.take_now = False
    for i in range(CONTROL_HIGH_WATER + 1):  # the first turned back (the writer's), then 256 queued
        conn.session.send(Pong(data=str(i)))
    assert not conn._space.is_set()  # the reader waits
    wire.take_now = True
    while len(wire.sent) < CONTROL_HIGH_WATER + 1:
        await asyncio.sleep(0)
    await _settle()
    assert conn._space.is_set()
    assert [f["data"] for _, f in wire.sent] == [str(i) for i in range(CONTROL_HIGH_WATER + 1)]
    for _ in range(CONTROL_HIGH_WATER):  # written as they come: never a backlog
        conn.session.send(Pong(data="again"))
        assert conn._space.is_set()
    writer.cancel()


async def test_without_the_extension_everything_goes_through_the_writer() -> None:
    wire = Wire(fast=False)
    conn, writer = _connection(wire)
    h = _chat(conn, "a")
    _step(h, "Hel")
    assert wire.sent == []  # nothing until the writer runs
    _step(h, "lo")
    await _settle()
    assert wire.frames("a") == ["start:", "delta:Hello"] and {how for how, _ in wire.sent} == {"task"}
    writer.cancel()


def test_the_servers_send_text_now_writes_unless_the_socket_cannot_take_it() -> None:
    """The real protocol under uvicorn, over a socket: a frame written at once; none while the transport has paused
    writing (its buffer over the high-water mark); again once it resumes; none once the peer has closed."""
    import threading
    import time

    import uvicorn
    from websockets.sync.client import connect

    from service.transport import SluiceWebSocketProtocol
    from tests.server import free_port

    results: dict[str, object] = {}

    async def app(scope, receive, send) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        now = scope["extensions"][SEND_TEXT_NOW]
        protocol = now.__self__
        sent = [now(b'{"n": 1}')]
        protocol.pause_writing()  # what the transport calls when its buffer fills
        sent.append(now(b'{"n": 2}'))
        protocol.resume_writing()
        sent.append(now('{"n": "3 é"}'.encode()))
        results["sent"] = sent
        assert (await receive())["type"] == "websocket.disconnect"
        results["after_close"] = now(b'{"n": 4}')

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, ws=SluiceWebSocketProtocol,
                                           lifespan="off", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        with connect(f"ws://127.0.0.1:{port}/") as ws:
            assert [json.loads(ws.recv(timeout=10)) for _ in range(2)] == [{"n": 1}, {"n": "3 é"}]
        deadline = time.monotonic() + 30
        while "after_close" not in results:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert results == {"sent": [True, False, True], "after_close": False}
    finally:
        server.should_exit = True
        thread.join(30)
