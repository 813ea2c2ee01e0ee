"""Hostile connections against real `sluice serve` processes: sockets without the key flooding the
authentication phase, slowloris (a bare connect, a head or body that never ends, a half-sent upgrade),
clients that drop mid-body or get refused, a key in the URL, a cross-site POST, a wrong `hello` after
`ready`, too many HTTP connections, a drain seen from a load balancer, clients that read nothing of their
output (WebSocket and HTTP), and floods of pings (docs/protocol.md §2, §7, §8).

Timeouts are set short by flags; "closed within its timeout" means closed within the timeout plus
MARGIN, a deadline only a very slow host could miss. Random choices are seeded; loops are bounded.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import re
import signal
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.hostile.conftest import read_until_closed, still_open
from tests.server import Server, start_server, wait_websockets
from tests.service.conftest import recv, send, user_chat

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD_ORIGIN, EVIL_ORIGIN = "http://good.example", "http://evil.example"
MODEL_FLAGS = ["--num-kv-blocks=256", "--max-model-len=1024"]
LONG = 1024 - 128  # a completion that cannot finish before the test hangs up on it
TIMEOUT = 1  # --timeout-headers, --timeout-body, --timeout-send and --timeout-keep-alive of `guarded`, in seconds
TIMEOUT_AUTH = 2  # its --timeout-auth
MARGIN = 10.0
MAX_CONNECTIONS, MAX_PENDING = 2, 4  # of `guarded`
HTTP_LIMIT, BOUNDED_MAX_CONNECTIONS, BOUNDED_PENDING = 4, 3, 2  # of `bounded`


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("hostile-guarded"), *MODEL_FLAGS, f"--max-connections={MAX_CONNECTIONS}",
        f"--max-connections-per-client={MAX_CONNECTIONS}",  # (every socket here is one address's)
        f"--max-pending-auth={MAX_PENDING}", f"--timeout-auth={TIMEOUT_AUTH}", f"--timeout-headers={TIMEOUT}",
        f"--timeout-body={TIMEOUT}", f"--timeout-send={TIMEOUT}", f"--timeout-keep-alive={TIMEOUT}",
        f"--allowed-origins={GOOD_ORIGIN}",
        env={"SLUICE_API_KEY": KEY})
    yield server
    assert server.stop() == 0, server.log_tail(60)
    assert "Traceback" not in server.log_text(), server.log_tail(80)


@pytest.fixture(scope="module")
def bounded(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Few HTTP connections and pending sockets, deadlines far beyond any test: what closes here was evicted."""
    server = start_server(
        tmp_path_factory.mktemp("hostile-bounded"), *MODEL_FLAGS, f"--max-http-connections={HTTP_LIMIT}",
        f"--max-connections={BOUNDED_MAX_CONNECTIONS}", f"--max-connections-per-client={BOUNDED_MAX_CONNECTIONS}",
        f"--max-pending-auth={BOUNDED_PENDING}",
        "--timeout-auth=600", "--timeout-headers=600", "--timeout-body=600", "--timeout-send=600",
        "--timeout-keep-alive=600",
        env={"SLUICE_API_KEY": KEY})
    yield server
    assert server.stop() == 0, server.log_tail(60)
    assert "Traceback" not in server.log_text(), server.log_tail(80)


async def _authed(server: Server) -> ClientConnection:
    ws = await connect(server.ws_url, additional_headers=AUTH)
    assert (await recv(ws))["type"] == "ready"
    return ws


async def _closed_with(ws: ClientConnection, within: float = MARGIN) -> tuple[list[dict], int | None]:
    """The frames a socket gets until the server closes it, and the close code."""
    frames = []
    try:
        async with asyncio.timeout(within):
            while True:
                frames.append(json.loads(await ws.recv()))
    except ConnectionClosed as e:
        return frames, e.rcvd.code if e.rcvd is not None else None


async def _raw(server: Server, data: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def _small_window(server: Server, limit: int = 1 << 16) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection on a socket with a small receive buffer, for clients that read little or nothing; `limit` is
    what the stream reader buffers before it stops reading the socket."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    return await asyncio.open_connection(sock=sock, limit=limit)


async def _raw_upgraded(server: Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket upgraded by hand on a socket with a small receive buffer, for clients that read little or nothing
    (frames are written raw: masked, as a client's must be)."""
    reader, writer = await _small_window(server)
    writer.write(f"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                 "Sec-WebSocket-Version: 13\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
    return reader, writer


async def _unread_stream(server: Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streamed chat completion on a socket with a small receive buffer, whose client reads nothing: its output
    (4 choices of LONG tokens with 20 logprobs each, megabytes) is far more than the sockets' buffers hold."""
    body = json.dumps({"model": "sluice-tiny-v1", "stream": True, "n": 4, "max_tokens": LONG, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "go"}]}).encode()
    reader, writer = await _small_window(server, limit=4096)  # (reads the socket only as we read)
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                 f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return reader, writer


async def _until_nothing_runs(server: Server) -> None:
    """Until the server runs no request (its metrics say), within MARGIN."""
    async with httpx.AsyncClient(base_url=server.url) as http:
        async with asyncio.timeout(MARGIN):
            while not re.search(r"^sluice_num_running 0", (await http.get("/metrics")).text, re.MULTILINE):
                await asyncio.sleep(0.1)


async def _cut_short(reader: asyncio.StreamReader) -> bool:
    """Reads the rest of a stream; True if the server dropped the connection before the stream's end."""
    data = b""
    try:
        async with asyncio.timeout(MARGIN):
            while chunk := await reader.read(1 << 16):
                data += chunk
    except ConnectionResetError:
        pass
    return b"data: [DONE]" not in data


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Close our side and wait for the server to close its own, so it no longer counts the connection."""
    writer.write_eof()
    await read_until_closed(reader, MARGIN)
    writer.close()


def _new_log(server: Server, offset: int) -> str:
    return server.log_text()[offset:]


# ---- 1. clients without the key cannot lock out clients with it ---------------------------------
async def test_keyless_flood_never_locks_out_clients_with_the_key(guarded: Server) -> None:
    rng = random.Random(13)
    stop = asyncio.Event()
    closes: Counter[int | None] = Counter()

    async def flooder() -> None:  # holds a socket without the key until the server drops it, then reopens
        while not stop.is_set():
            try:
                ws = await connect(guarded.ws_url)
            except InvalidStatus as e:  # 503 while a closing client's slot is not yet free: try again
                assert e.response.status_code == 503
                await asyncio.sleep(0.5)
                continue
            frames, code = await _closed_with(ws, TIMEOUT_AUTH + MARGIN)
            assert [f["code"] for f in frames] == ["overloaded" if code == 1013 else "unauthorized"], frames
            closes[code] += 1
            await asyncio.sleep(0.5)

    flood = [asyncio.create_task(flooder()) for _ in range(MAX_PENDING + 2)]
    try:
        await asyncio.sleep(0.5)  # the pending pool is full
        for _ in range(8):  # each way of authenticating, every time
            ws = await _authed(guarded)
            await ws.close()
            ws = await connect(guarded.ws_url)
            await send(ws, type="hello", api_key=KEY)
            assert (await recv(ws))["type"] == "ready"
            await ws.close()
            await asyncio.sleep(rng.uniform(0.0, 0.3))
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*flood), TIMEOUT_AUTH + MARGIN)
    assert set(closes) <= {1008, 1013} and closes[1013] >= 1, closes  # evicted, or timed out: nothing else
    await wait_websockets(guarded, 0)


async def test_a_socket_that_never_says_hello_is_closed_1008(guarded: Server) -> None:
    ws = await connect(guarded.ws_url)
    start = time.monotonic()
    frames, code = await _closed_with(ws, TIMEOUT_AUTH + MARGIN)
    assert code == 1008 and [f["code"] for f in frames] == ["unauthorized"], (code, frames)
    assert time.monotonic() - start >= TIMEOUT_AUTH - 0.25  # (the clock starts after the handshake: a little late)


async def test_pending_sockets_push_out_only_each_other(bounded: Server) -> None:
    pending = [await connect(bounded.ws_url) for _ in range(BOUNDED_PENDING)]
    newest = await connect(bounded.ws_url)  # one more: the oldest is evicted
    frames, code = await _closed_with(pending[0])
    assert code == 1013 and frames[0]["code"] == "overloaded" and frames[0]["id"] is None, (code, frames)
    authed = [await _authed(bounded) for _ in range(BOUNDED_MAX_CONNECTIONS)]  # pending ones hold no slot
    await send(pending[1], type="hello", api_key=KEY)  # the right key, but every slot is taken now
    frames, code = await _closed_with(pending[1])
    assert code == 1013 and frames[0]["code"] == "overloaded", (code, frames)
    await authed[0].close()
    await wait_websockets(bounded, 1 + BOUNDED_MAX_CONNECTIONS - 1)  # `newest`, and the authenticated left
    await send(newest, type="hello", api_key=KEY)
    assert (await recv(newest))["type"] == "ready"
    for ws in [newest, *authed[1:]]:
        await ws.close()
    await wait_websockets(bounded, 0)


async def test_one_client_holds_at_most_its_share_of_the_connections(tiny_model_dir, tmp_path) -> None:
    """`--max-connections=4`: one address may hold two (`--max-connections-per-client`, half by default); its third
    upgrade gets 429 (Retry-After), its socket that was waiting to authenticate gets `overloaded` and 1013 at its
    `hello`, and another address still connects. Before, one client (with the key, or on a server without one) could
    take every slot, and every other client got 503 until it let one go."""
    server = start_server(tmp_path, *MODEL_FLAGS, "--max-connections=4", env={"SLUICE_API_KEY": KEY})
    try:
        pending = await connect(server.ws_url)  # (holds no slot until its `hello`)
        held = [await _authed(server) for _ in range(2)]
        with pytest.raises(InvalidStatus) as refused:
            await connect(server.ws_url, additional_headers=AUTH)
        response = refused.value.response
        assert response.status_code == 429 and response.headers["retry-after"] == "1", response
        assert b"--max-connections-per-client" in response.body, response.body
        await send(pending, type="hello", api_key=KEY)
        frames, code = await _closed_with(pending)
        assert code == 1013 and frames[0]["code"] == "overloaded", (code, frames)
        assert "--max-connections-per-client" in frames[0]["message"], frames
        other = await connect(server.ws_url, additional_headers=AUTH, local_addr=("127.0.0.2", 0))
        assert (await recv(other))["type"] == "ready"
        await held[0].close()
        await wait_websockets(server, 2)
        again = await _authed(server)  # (its share has room again)
        for ws in [*held[1:], other, again]:
            await ws.close()
    finally:
        assert server.stop() == 0, server.log_tail(60)
    assert "Traceback" not in server.log_text(), server.log_tail(80)


# ---- 2. expected client behaviour logs one line, never a traceback --------------------------------
async def test_drops_mid_body_bad_utf8_and_refused_upgrades_log_no_error(guarded: Server) -> None:
    offset = len(guarded.log_text())
    ws = await _authed(guarded)
    await ws.send(b"\xff\xfe not UTF-8", text=True)
    assert (await _closed_with(ws))[1] == 1007
    drops = 5
    for k in range(drops):
        _, writer = await _raw(guarded, (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: 1000\r\n\r\n" + '{"model": "m", ' * (k + 1)).encode())
        await asyncio.sleep(0.05)
        writer.close()
    with pytest.raises(InvalidStatus) as info:
        await connect(guarded.ws_url, origin=EVIL_ORIGIN, additional_headers=AUTH)
    assert info.value.response.status_code == 403
    await wait_websockets(guarded, 0)
    full = [await _authed(guarded) for _ in range(MAX_CONNECTIONS)]
    with pytest.raises(InvalidStatus) as info:
        await connect(guarded.ws_url, additional_headers=AUTH)
    assert info.value.response.status_code == 503
    assert info.value.response.headers["Retry-After"] == "5"  # as the HTTP API's 503s
    for ws in full:
        await ws.close()
    await wait_websockets(guarded, 0)

    deadline = time.monotonic() + MARGIN
    while _new_log(guarded, offset).count("before sending the whole body") < drops:
        assert time.monotonic() < deadline, _new_log(guarded, offset)
        await asyncio.sleep(0.1)
    log = _new_log(guarded, offset)
    assert "Traceback" not in log and "ERROR" not in log and "WARNING" not in log, log
    assert log.count("before sending the whole body") == drops, log  # one line per drop
    assert log.count("not UTF-8") == 1, log
    assert log.count('"WebSocket /v1/ws" 403') == 1 and log.count('"WebSocket /v1/ws" 503') == 1, log
    assert "connection rejected" not in log, log  # websockets' second line for the same refusal


# ---- 3. slowloris: every way of sending nothing is timed out -------------------------------------
HEAD = b"GET /health HTTP/1.1\r\nhost: x\r\n"
SLOW = {
    "bare connect": (b"", None, b""),
    "head that never ends": (HEAD, b"x-slow: " + b"a" * 64, b"HTTP/1.1 408 "),
    "body that never arrives": (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                                "content-type: application/json\r\ncontent-length: 100\r\n\r\n".encode(),
                                None, b"HTTP/1.1 408 "),
    "half-sent upgrade": (b"GET /v1/ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                          b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
                          None, b"HTTP/1.1 408 "),
}


@pytest.mark.parametrize("case", SLOW)
async def test_slowloris_is_closed_within_its_timeout(guarded: Server, case: str) -> None:
    first, dribble, answer = SLOW[case]
    reader, writer = await _raw(guarded, first)

    async def drip() -> None:  # a byte every 0.2 s: a head's deadline is not reset by progress
        for byte in dribble or b"":
            await asyncio.sleep(0.2)
            writer.write(bytes([byte]))

    dripping = asyncio.create_task(drip())
    try:
        data, took = await read_until_closed(reader, TIMEOUT + MARGIN)
    finally:
        dripping.cancel()
        writer.close()
    assert data.startswith(answer) and (answer or not data), data
    assert took >= TIMEOUT - 0.25, took  # (its clock starts after the connect: a little late)
    if answer:
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"


# ---- 4. the smaller ones -------------------------------------------------------------------------
async def test_wrong_key_hello_after_ready_closes_1008(guarded: Server) -> None:
    ws = await _authed(guarded)
    await send(ws, type="hello", api_key=KEY)
    assert (await recv(ws))["type"] == "ready"  # the right key again: harmless
    await send(ws, type="hello", api_key="guess")
    await ws.send(json.dumps(user_chat("after", "hi", max_tokens=2)))  # must not run
    frames, code = await _closed_with(ws)
    assert code == 1008, (code, frames)
    assert frames == [{"type": "error", "code": "unauthorized", "message": frames[0]["message"], "id": None}], frames


async def test_query_strings_stay_out_of_the_log(guarded: Server) -> None:
    offset = len(guarded.log_text())
    async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH) as http:
        assert (await http.get("/v1/models", params={"api_key": "SECRET-ONE"})).status_code == 200
    ws = await connect(f"{guarded.ws_url}?api_key=SECRET-TWO", additional_headers=AUTH)
    assert (await recv(ws))["type"] == "ready"
    await ws.close()
    deadline = time.monotonic() + MARGIN
    while "/v1/ws?" not in _new_log(guarded, offset):
        assert time.monotonic() < deadline, _new_log(guarded, offset)
        await asyncio.sleep(0.1)
    log = _new_log(guarded, offset)
    assert "SECRET" not in log, log
    assert "/v1/models?<redacted>" in log and "/v1/ws?<redacted>" in log, log


@pytest.mark.parametrize("writes", [1, 2])
async def test_a_head_over_16_kib_is_refused_however_it_arrives(guarded: Server, writes: int) -> None:
    """§8: 400 and closed. In one write (one read of the server's) h11 alone would take a 60 KB head whole; in two,
    its buffer bound catches it. A head just under the bound, and the same request, are answered."""
    def head(size: int) -> bytes:
        return b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * size + b"\r\n\r\n"

    big = head(60_000)
    reader, writer = await _raw(guarded, big[: len(big) // writes])
    if writes == 2:
        writer.write(big[len(big) // writes :])
        await writer.drain()
    answer, _ = await read_until_closed(reader, MARGIN)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    writer.close()
    reader, writer = await _raw(guarded, head(16_000))
    assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200 ")
    await _hang_up(reader, writer)


async def test_a_request_with_both_content_length_and_transfer_encoding_is_refused_and_closed(
        guarded: Server) -> None:
    """RFC 9112 §6.3: the server must close the connection after such a request. h11 read the body by its chunks and
    kept the connection, and answered a `GET /health` sent after them, which a proxy going by Content-Length would have
    taken for the body: a request smuggled past it. Now: 400, closed, nothing after it read."""
    reader, writer = await _raw(guarded, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                         b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                                         b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    try:
        answered = await asyncio.wait_for(reader.read(), MARGIN)  # (to the end: the server closes)
    finally:
        writer.close()
    assert answered.startswith(b"HTTP/1.1 400") and answered.count(b"HTTP/1.1 ") == 1, answered[:300]


@pytest.mark.parametrize("target", [b"http://x/health", b"HTTP://127.0.0.1:1/health?probe=1", b"http://x"])
async def test_a_target_in_absolute_form_is_routed_by_its_path(guarded: Server, target: bytes) -> None:
    """RFC 9112 §3.2.2: a server must accept a request target in absolute form (`GET http://host/health`); it was a
    404 (routed by the whole URI). A bare authority is the root."""
    reader, writer = await _raw(guarded, b"GET " + target + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    try:
        answered = await asyncio.wait_for(reader.read(), MARGIN)
    finally:
        writer.close()
    assert answered.startswith(b"HTTP/1.1 200 OK"), answered[:300]
    head = answered.split(b"\r\n\r\n", 1)[0].lower()
    assert (b"content-type: application/json" in head) == (b"health" in target), head  # (/health's, or the UI's page)


async def test_origin_allow_list_guards_http_too(guarded: Server) -> None:
    body = json.dumps({"model": "sluice-tiny-v1", "prompt": "hi", "max_tokens": 1})
    plain = {"content-type": "text/plain"}  # a "simple" cross-site request: browsers send it without preflight
    async with httpx.AsyncClient(base_url=guarded.url) as http:
        for headers in ({**plain, **AUTH, "origin": EVIL_ORIGIN}, {**plain, "origin": EVIL_ORIGIN}):
            r = await http.post("/v1/completions", content=body, headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        for headers in ({**plain, **AUTH, "origin": GOOD_ORIGIN}, {**plain, **AUTH}):  # no Origin: not a browser
            r = await http.post("/v1/completions", content=body, headers=headers)
            assert r.status_code == 200, r.text


# ---- 3. a bound on HTTP connections that slow clients cannot fill --------------------------------
async def test_at_the_bound_the_longest_waiting_connection_makes_room(bounded: Server) -> None:
    # WebSockets leave the HTTP count at the upgrade
    sockets = [await _authed(bounded) for _ in range(BOUNDED_MAX_CONNECTIONS)]
    # bodies that never come: the head is read (the server asks for the body), the connection waits on its client
    slow = []
    for _ in range(HTTP_LIMIT):
        reader, writer = await _raw(bounded, (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\nexpect: 100-continue\r\n"
            "content-type: application/json\r\ncontent-length: 100\r\n\r\n").encode())
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), MARGIN)).startswith(b"HTTP/1.1 100 ")
        slow.append((reader, writer))
    async with httpx.AsyncClient(base_url=bounded.url) as http:
        assert (await http.get("/health")).status_code == 200  # evicts the oldest slow one
    data, _ = await read_until_closed(slow[0][0], MARGIN)
    assert data.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in data, data
    assert all([await still_open(reader) for reader, _ in slow[1:]])
    slow[0][1].close()
    for reader, writer in slow[1:]:
        await _hang_up(reader, writer)
    # idle connections (no byte sent) are evicted the same way, silently
    idle = [await _raw(bounded) for _ in range(HTTP_LIMIT)]
    async with httpx.AsyncClient(base_url=bounded.url) as http:
        assert (await http.get("/health")).status_code == 200
    assert (await read_until_closed(idle[0][0], MARGIN))[0] == b""
    idle[0][1].close()
    for reader, writer in idle[1:]:
        await _hang_up(reader, writer)
    for ws in sockets:  # untouched
        await send(ws, type="ping", data=1)
        assert await recv(ws) == {"type": "pong", "data": 1}
        await ws.close()
    await wait_websockets(bounded, 0)


async def test_when_every_connection_runs_a_request_a_new_one_gets_503(bounded: Server) -> None:
    body = json.dumps({"model": "sluice-tiny-v1", "prompt": "go", "max_tokens": LONG, "ignore_eos": True,
                       "stream": True}).encode()
    busy = []
    for _ in range(HTTP_LIMIT):
        reader, writer = await _raw(bounded, (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), MARGIN)).startswith(b"HTTP/1.1 200 ")
        busy.append(writer)
    reader, writer = await _raw(bounded)
    data, _ = await read_until_closed(reader, MARGIN)
    writer.close()
    assert data.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in data, data
    for writer in busy:  # hanging up cancels the streams
        writer.close()
    deadline = time.monotonic() + MARGIN
    while True:  # and frees their slots
        try:
            if httpx.get(f"{bounded.url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "no slot came free after the streams were closed"
        await asyncio.sleep(0.1)


async def test_a_stream_read_slowly_but_steadily_is_not_dropped(guarded: Server) -> None:
    """A client that reads its stream slowly (4 KiB every 0.2 s) keeps it through many --timeout-send periods: the
    deadline is for a client that takes nothing (the write buffer's size alone moved too coarsely to show a slow
    reader's progress, and such clients were dropped)."""
    offset = len(guarded.log_text())
    reader, writer = await _unread_stream(guarded)
    for _ in range(int(8 * TIMEOUT / 0.2)):  # (8 periods, ~130 KB: far less than the stream, by construction)
        assert await asyncio.wait_for(reader.read(4096), MARGIN), "a stream being read was closed"
        await asyncio.sleep(0.2)
    assert "(--timeout-send)" not in _new_log(guarded, offset), guarded.log_tail(10)
    writer.close()
    await _until_nothing_runs(guarded)


async def test_at_the_bound_a_stream_whose_client_reads_nothing_makes_room(bounded: Server) -> None:
    """Every connection runs a stream that its client does not read: once one is stalled on its client it is
    waiting on it as a slow request is, and the longest-stalled one is dropped to make room (they all held their
    slots, so /health and every upgrade answered 503, for as long as the clients kept their sockets open)."""
    offset = len(bounded.log_text())
    streams = [await _unread_stream(bounded) for _ in range(HTTP_LIMIT)]
    deadline = time.monotonic() + 60  # (until a stream's output fills the buffers)
    async with httpx.AsyncClient(base_url=bounded.url) as http:
        while (await http.get("/health", headers={"connection": "close"})).status_code != 200:
            assert time.monotonic() < deadline, "no stalled stream made room"
            await asyncio.sleep(0.2)
    dropped = re.search(r"127\.0\.0\.1:(\d+): POST \S+: closed while its client was not reading the response, to make "
                        r"room", _new_log(bounded, offset))
    assert dropped, bounded.log_tail(20)
    # (the one stalled longest: which one that is depends on when each one's output filled its buffers)
    reader = next(r for r, w in streams if w.get_extra_info("sockname")[1] == int(dropped[1]))
    assert await _cut_short(reader)
    for reader, writer in streams:
        writer.close()
    await _until_nothing_runs(bounded)


# ---- 4. draining, as a load balancer sees it ----------------------------------------------------
async def test_draining_is_visible_on_health_until_the_listener_closes(tiny_model_dir, tmp_path) -> None:
    # (a chat of thousands of steps: still running after the checks below on however fast a CPU)
    server = start_server(tmp_path, "--num-kv-blocks=512", "--max-model-len=4096", "--timeout-graceful-shutdown=60")
    try:
        ws = await connect(server.ws_url)
        assert (await recv(ws))["type"] == "ready"
        await ws.send(json.dumps(user_chat("long", "go on", max_tokens=4096 - 128, ignore_eos=True)))
        assert (await recv(ws))["type"] == "start"  # the drain now lasts until this chat ends
        server.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(base_url=server.url) as http:
            deadline = time.monotonic() + MARGIN
            while (r := await http.get("/health", headers={"connection": "close"})).status_code == 200:
                assert time.monotonic() < deadline, "still healthy after SIGTERM"
                await asyncio.sleep(0.05)
            assert r.status_code == 503 and r.json() == {"status": "draining"}, r.text
            r = await http.post("/v1/completions", json={"model": "sluice-tiny-v1", "prompt": "hi"})
            assert r.status_code == 503, r.text
        with pytest.raises(InvalidStatus) as info:
            await connect(server.ws_url)
        assert info.value.response.status_code == 503 and info.value.response.headers["Retry-After"] == "5"
        await send(ws, type="cancel", id="long")
        frames, code = await _closed_with(ws, MARGIN)
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled" and code == 1001
        assert await asyncio.to_thread(server.proc.wait, MARGIN * 3) == 0, server.log_tail(40)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")
        assert "Traceback" not in server.log_text() and "ERROR" not in server.log_text(), server.log_tail(60)
    finally:
        server.stop()


async def test_a_request_answered_before_its_body_is_whole_is_closed(bounded: Server) -> None:
    """A 413 for a declared 1 TB body, then the client trickles bytes on: the server closes the connection
    (it used to read the rest for nobody, for as long as the client kept sending)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", bounded.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
                 + b"\r\ncontent-type: application/json\r\ncontent-length: 1000000000000\r\n\r\n{")
    await writer.drain()

    async def trickle() -> None:
        with contextlib.suppress(OSError):
            for _ in range(int(MARGIN * 10)):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.1)

    sender = asyncio.create_task(trickle())
    try:
        data, _ = await read_until_closed(reader, MARGIN)
    finally:
        sender.cancel()
        writer.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]


async def test_a_large_first_frame_is_refused_unread(guarded: Server) -> None:
    """A client without the key cannot make the loop decode costly frames (the loop budget charges authenticated
    connections only): a first frame longer than any `hello` is refused before it is decoded, a real `hello` padded
    with whitespace as well, while one with the key, as long as a key allows, still gets in."""
    costly = json.dumps({"type": "chat", "id": "x", "messages": [{"role": "user", "content": ""}] * 20_000})
    padded = json.dumps({"type": "hello", "api_key": KEY}) + " " * 4096
    for frame in (costly, padded):
        ws = await connect(guarded.ws_url, max_size=None)
        await ws.send(frame)
        frames, code = await _closed_with(ws)
        assert code == 1008 and frames[0]["code"] == "unauthorized" and "at most" in frames[0]["message"], frames
    ws = await connect(guarded.ws_url)
    await ws.send(json.dumps({"type": "hello", "api_key": KEY}, indent=8))  # (whitespace within the bound)
    assert (await recv(ws))["type"] == "ready"
    await ws.close()
    await wait_websockets(guarded, 0)


async def test_a_socket_that_reads_nothing_is_dropped_at_its_keepalive_deadline(tiny_model_dir, tmp_path) -> None:
    """A client that never reads, with more output owed to it than the sockets' buffers hold, and that answers no
    keepalive ping: at the ping's deadline its socket is dropped and its chat stopped (closing it alone waited for
    the unsent bytes for ever, keeping the chat, the memory and the connection's slot)."""
    server = start_server(tmp_path, *MODEL_FLAGS, "--ws-ping-interval=1", "--ws-ping-timeout=1")
    try:
        reader, writer = await _raw_upgraded(server)
        frames = [json.dumps(user_chat("long", "go", max_tokens=LONG, ignore_eos=True))]
        frames += [json.dumps({"type": "ping", "data": "x" * 900_000})] * 16
        for text in frames:  # (masked client frames; nothing is read from here on)
            data = text.encode()
            writer.write(bytes([0x81, 0xFF]) + len(data).to_bytes(8, "big") + bytes(4) + data)
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(5):
                await writer.drain()
        await wait_websockets(server, 0, timeout=MARGIN + 2)
        await _until_nothing_runs(server)  # (its chat stopped, not run to its end: LONG tokens take far longer)
        writer.transport.abort()
    finally:
        assert server.stop() == 0, server.log_tail(60)


async def test_a_ping_flood_from_a_client_that_reads_nothing_is_held_back_by_tcp(guarded: Server) -> None:
    """WebSocket pings from a client that reads none of the pongs (no key needed): once the pongs it owes fill the
    socket's write buffer the server reads no more, so the client's sends stop (its memory was the flood's size)."""
    reader, writer = await _raw_upgraded(guarded)
    ping = bytes([0x89, 0x80 | 125]) + bytes(4) + b"p" * 125  # (masked with zeros)
    chunk, sent = ping * ((1 << 20) // len(ping)), 0  # (~1 MB a write)
    try:
        with pytest.raises(TimeoutError):  # (without the bound the server took all 64 MB in a few seconds)
            async with asyncio.timeout(MARGIN):
                while sent < 64 << 20:
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)
        assert sent < 32 << 20, sent
    finally:
        writer.transport.abort()


async def test_a_stream_whose_client_reads_nothing_is_dropped_at_its_send_deadline(guarded: Server) -> None:
    """An HTTP stream whose client takes none of it: once its output fills the sockets' buffers, the connection is
    dropped after --timeout-send and the request stopped (the response waited on the socket for ever, holding its
    connection slot and its request)."""
    offset = len(guarded.log_text())
    reader, writer = await _unread_stream(guarded)
    deadline = time.monotonic() + 60  # (until the output fills the buffers, then TIMEOUT)
    while "(--timeout-send): dropped" not in _new_log(guarded, offset):
        assert time.monotonic() < deadline, guarded.log_tail(20)
        await asyncio.sleep(0.1)
    assert await _cut_short(reader)
    writer.close()
    await _until_nothing_runs(guarded)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Hangs up with a TCP reset: the server's kernel drops what it has not read yet (a close would have it
    read every byte still queued first, slowly, at the connection's loop share)."""
    with contextlib.suppress(OSError):  # (already closed: by the server, or by the test)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far, all its threads."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _flood(server: Server, writer: asyncio.StreamWriter, chunk: bytes, seconds: float = 5.0,
                 answers: asyncio.StreamReader | None = None) -> tuple[float, float]:
    """Writes `chunk` again and again for `seconds`, as fast as TCP takes it (reading whatever comes back on
    `answers` meanwhile), then hangs up with a reset; the server's CPU seconds meanwhile, and the seconds it took."""
    cpu, start = _cpu_seconds(server.proc.pid), time.monotonic()
    reading = asyncio.create_task(_read_all(answers)) if answers is not None else None
    try:
        while time.monotonic() - start < seconds:
            writer.write(chunk)
            with contextlib.suppress(TimeoutError):  # (held back by TCP: the loop still counts the time)
                async with asyncio.timeout(start + seconds - time.monotonic()):
                    await writer.drain()
        return _cpu_seconds(server.proc.pid) - cpu, time.monotonic() - start
    finally:
        if reading is not None:
            reading.cancel()
        _reset(writer)


@pytest.fixture
def flood_target(tiny_model_dir, tmp_path) -> Iterator[Server]:
    """A server of its own: what a flooding socket left in the server's receive buffer is still read, at its loop
    share, after the test hangs up (and would be counted in the next test's CPU time)."""
    server = start_server(tmp_path, *MODEL_FLAGS, env={"SLUICE_API_KEY": KEY})
    yield server
    assert server.stop() == 0, server.log_tail(60)
    assert "Traceback" not in server.log_text(), server.log_tail(80)


async def test_a_stream_of_tiny_frames_gets_the_loop_share_of_one_connection(flood_target: Server) -> None:
    """Empty pings as fast as TCP takes them, from a socket without the key that reads its pongs: each costs the loop
    microseconds in the frame parser and the pong's write, and no message ever reaches the app's budget, so the
    server's event loop ran this one socket flat out (a good client's deliveries waited behind it). Its reads are
    charged to its loop budget now: the server spends about its 10% share on it. Measured as the server's CPU time
    over the flood, against the flood's length: a ratio, whatever the CPU's speed."""
    reader, writer = await _raw_upgraded(flood_target)
    ping = bytes([0x89, 0x80]) + bytes(4)  # (an empty ping, masked with zeros)
    chunk = ping * ((1 << 16) // len(ping))
    cpu, elapsed = await _flood(flood_target, writer, chunk, answers=reader)
    assert cpu < 0.4 * elapsed, f"the server spent {cpu:.2f} s of CPU in {elapsed:.2f} s on one flooding socket"


async def test_tiny_frames_on_many_sockets_get_the_loop_share_of_one_client(flood_target: Server) -> None:
    """The same flood of empty pings on eight sockets of one address at once: each socket had a share of its own, and
    eight sockets ran the loop flat out. A client's connections share one budget now."""
    sockets = [await _raw_upgraded(flood_target) for _ in range(8)]
    ping = bytes([0x89, 0x80]) + bytes(4)
    chunk = ping * ((1 << 16) // len(ping))
    floods = [_flood(flood_target, writer, chunk, answers=reader) for reader, writer in sockets]
    cpu, elapsed = (await asyncio.gather(*floods))[0]
    assert cpu < 0.4 * elapsed, f"the server spent {cpu:.2f} s of CPU in {elapsed:.2f} s on eight flooding sockets"


def _rss_bytes(pid: int) -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", open(f"/proc/{pid}/status").read(), re.MULTILINE)[1]) << 10


async def test_a_message_in_tiny_fragments_holds_about_its_bytes(flood_target: Server) -> None:
    """A text message of 512 KiB (under --max-message-bytes) sent as 2-byte fragments and left unfinished: the server
    holds about its bytes, not ~30 times them (uvicorn kept each fragment as a bytes object of its own: 29 MB a
    socket for a message of 1 MiB). Measured at the pong to a ping sent behind the fragments: all parsed by then."""
    reader, writer = await _small_window(flood_target)
    writer.write(f"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                 f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
    before = _rss_bytes(flood_target.proc.pid)
    fragments = 256 << 10
    writer.write(bytes([0x01, 0x82]) + bytes(4) + b"[ ")  # a text frame, not the last of its message (masked zeros)
    for _ in range(16):
        writer.write((bytes([0x00, 0x82]) + bytes(4) + b"  ") * (fragments // 16))  # continuations
        await writer.drain()
    writer.write(bytes([0x89, 0x80]) + bytes(4))  # a ping
    try:
        async with asyncio.timeout(MARGIN * 12):  # (the fragments are parsed at the client's loop share)
            while True:
                first, size = await reader.readexactly(2)
                if size in (126, 127):
                    size = int.from_bytes(await reader.readexactly(2 if size == 126 else 8), "big")
                await reader.readexactly(size)
                if first == 0x8A:
                    break
        grown = _rss_bytes(flood_target.proc.pid) - before
        assert grown < 4 * (2 * fragments), f"a message of {2 * fragments >> 10} KiB held unfinished: {grown >> 20} MB"
    finally:
        _reset(writer)


async def test_a_body_of_tiny_chunks_gets_the_loop_share_of_its_peer(flood_target: Server) -> None:
    """A chunked request body sent as 1-byte chunks as fast as TCP takes them: h11 parses each one on the loop, and
    the server ran flat out on this one connection until the body reached its megabyte. Its reads are charged to
    its peer's loop budget now, as the same test of tiny WebSocket frames measures."""
    reader, writer = await _raw(flood_target, (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
        "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n").encode())
    chunk = b"1\r\n \r\n" * ((1 << 16) // 6)  # (whitespace: the body, if it ever ended, would still be valid JSON)
    cpu, elapsed = await _flood(flood_target, writer, chunk)
    assert cpu < 0.4 * elapsed, f"the server spent {cpu:.2f} s of CPU in {elapsed:.2f} s on one chunked body"


async def test_cheap_pipelined_requests_get_the_loop_share_of_their_peer(flood_target: Server) -> None:
    """`GET /metrics` (open without the key) pipelined as fast as TCP takes it, its answers read: each costs the loop
    about a millisecond and makes no work for the engine, and the server's loop ran flat out on this one connection
    (4.97 s of CPU in a 5 s flood). A request's handling is charged to its peer's loop budget now, and the next
    pipelined request waits while that is spent."""
    reader, writer = await _raw(flood_target)
    cpu, elapsed = await _flood(flood_target, writer, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * 256, answers=reader)
    assert cpu < 0.4 * elapsed, f"the server spent {cpu:.2f} s of CPU in {elapsed:.2f} s on pipelined requests"


async def test_a_body_of_tiny_chunks_pipelined_behind_a_request_the_engine_has_gets_the_loop_share(
        flood_target: Server) -> None:
    """A completion (one token: the engine has it, and its handling is no longer charged), and pipelined right behind
    it one whose chunked body is 40,000 1-byte chunks, again and again. What was read while the first ran went into
    h11 whole and was parsed at once when its response completed (~0.3 s of the loop for a read of them), charged to
    no one (4.88 s of CPU in a 5 s flood); it waits now, and is parsed a slice at a time, charged, as any read
    (0.54 s)."""
    model = httpx.get(f"{flood_target.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    first = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    body = b"1\r\n \r\n" * 40_000 + b"%x\r\n%s\r\n0\r\n\r\n" % (len(first), first)  # (whitespace, then the JSON)
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n".encode()
    pair = (head + f"content-type: application/json\r\ncontent-length: {len(first)}\r\n\r\n".encode()
            + first + head + b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n" + body)
    reader, writer = await _raw(flood_target)
    cpu, elapsed = await _flood(flood_target, writer, pair, answers=reader)
    assert cpu < 0.4 * elapsed, f"the server spent {cpu:.2f} s of CPU in {elapsed:.2f} s on pipelined chunked bodies"


async def test_a_connection_per_request_gets_the_loop_share_of_its_peer(flood_target: Server) -> None:
    """The same cheap requests (`GET /health`), each on a connection of its own, eight at a time: no connection lives
    long enough to wait for anything, and the loop ran flat out (4.97 s of CPU in 5 s, 24,000 requests). A new
    connection of a peer that has spent its budget is not read until it has refilled."""
    cpu, start = _cpu_seconds(flood_target.proc.pid), time.monotonic()

    async def one_after_another() -> None:
        while time.monotonic() - start < 5.0:
            reader, writer = await _raw(flood_target, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            try:
                with contextlib.suppress(TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                    async with asyncio.timeout(start + 5.0 - time.monotonic()):
                        await reader.readuntil(b"\r\n\r\n")
            finally:
                _reset(writer)

    await asyncio.gather(*(one_after_another() for _ in range(8)))
    cpu, elapsed = _cpu_seconds(flood_target.proc.pid) - cpu, time.monotonic() - start
    assert cpu < 0.4 * elapsed, f"the server spent {cpu:.2f} s of CPU in {elapsed:.2f} s on new connections"


async def test_pipelined_requests_held_for_the_budget_are_all_answered_in_order(flood_target: Server) -> None:
    """200 `GET /metrics` in one write (about 0.1 s of the loop's time, past the 10 ms burst: the later ones wait for
    the budget, each after the last one's answer) and a last `GET /health`: every one is answered, in order."""
    reader, writer = await _raw(flood_target, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * 200
                                + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    try:
        for i in range(201):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), MARGIN * 3)
            assert head.startswith(b"HTTP/1.1 200 OK"), (i, head)
            body = await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE)[1]))
            assert body.startswith(b'{"status"') == (i == 200), (i, body[:80])
    finally:
        writer.close()


async def _read_all(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(1 << 16):
            pass


async def _get_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, then: bytes = b"") -> bytes:
    """GET /health on a kept-alive connection (and `then` right behind it); its status line."""
    writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" + then)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), MARGIN * 3)
    await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE)[1]))
    return head.split(b"\r\n")[0]


async def test_a_peer_held_to_its_loop_budget_loses_nothing(tiny_model_dir, tmp_path) -> None:
    """While a peer's HTTP reads wait for its loop budget (its other connections sent ~220,000 one-byte body chunks,
    all in the server's socket buffers before the peer's next connection opens: ~0.2 s of parsing at the least, 2 s
    of waiting at a 10% share), the next request on its kept-alive connection, sent as soon as the first is answered,
    waits unread past --timeout-keep-alive and is answered (the keep-alive timer closed the connection with the
    request unread), and a WebSocket it upgrades meanwhile is read by its own budget (the held reads were never
    resumed: no pong, ever). (However short the wait on a fast CPU, the request is answered: only the test's reach
    shrinks, never its verdict.)"""
    server = start_server(tmp_path, *MODEL_FLAGS, "--timeout-keep-alive=1")
    floods = [await _raw(server) for _ in range(20)]
    try:
        for _, writer in floods:
            writer.transport.set_write_buffer_limits(high=0)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: chunked\r\n\r\n" + b"1\r\n \r\n" * ((64 << 10) // 6))
        for _, writer in floods:  # (all handed to TCP: the server reads them before the next connection's request)
            await writer.drain()
        kept = await _raw(server)
        upgrading = await _raw(server)
        upgrade = (f"GET /v1/ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                   f"sec-websocket-key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                   "sec-websocket-version: 13\r\n\r\n").encode()

        async def keep_alive() -> None:
            assert await _get_health(*kept) == b"HTTP/1.1 200 OK"
            assert await _get_health(*kept) == b"HTTP/1.1 200 OK"  # (sent while the connection's reads are held)

        async def upgrade_while_held() -> None:
            reader, writer = upgrading
            assert await _get_health(reader, writer, upgrade[:10]) == b"HTTP/1.1 200 OK"  # (h11 holds the rest)
            writer.write(upgrade[10:])
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), MARGIN * 3)).startswith(b"HTTP/1.1 101")
            writer.write(bytes([0x89, 0x82]) + bytes(4) + b"hi")  # a ping, masked with zeros
            async with asyncio.timeout(MARGIN):  # the frames up to the pong (`ready` first)
                while True:
                    first, size = await reader.readexactly(2)
                    if size in (126, 127):
                        size = int.from_bytes(await reader.readexactly(2 if size == 126 else 8), "big")
                    payload = await reader.readexactly(size)
                    if first == 0x8A:
                        assert payload == b"hi"
                        break

        await asyncio.gather(keep_alive(), upgrade_while_held())
    finally:
        for _, writer in [*floods, kept, upgrading]:
            _reset(writer)
        assert server.stop() == 0, server.log_tail(60)
    assert "Traceback" not in server.log_text(), server.log_tail(80)
