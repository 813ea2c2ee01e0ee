"""WebSocket endpoint `/v1/ws` (docs/protocol.md): the socket side of a connection. Its protocol is a
`ws_session.Session` (no I/O); here are the upgrade checks, authentication, and two tasks per connection: this
one reads (and pauses while the session has too many unsent control replies), one writer sends.

Under Sluice's own server (service/transport.py) output the session has is written at once, in the call that
made it (an engine step's delivery, a control reply), without waking the writer task or the ASGI layers, while
the socket takes it: a step's fan-out to many sockets is one pass. The writer sends the rest, in order: frames
the socket's full buffer turned back, a close, everything under another server.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from starlette.responses import PlainTextResponse
from starlette.status import (
    WS_1001_GOING_AWAY, WS_1008_POLICY_VIOLATION, WS_1011_INTERNAL_ERROR, WS_1013_TRY_AGAIN_LATER,
)
from starlette.websockets import WebSocket, WebSocketDisconnect

from service.auth import bearer_token, key_matches, origin_allowed
from service.budget import stop_metering
from service.handle import client_of
from service.openai_errors import RETRY_AFTER_S
from service.protocol import ErrorCode, Error, Hello, ServerMessage, decode_client, encode, encode_utf8
from service.transport import CHARGE_TO, SEND_TEXT_NOW
from service.ws_session import Session

if TYPE_CHECKING:
    from service.state import Service

log = logging.getLogger("sluice.ws")

HELLO_BYTES = 256  # a `hello` frame's characters besides its key's


class Connection:
    def __init__(self, ws: WebSocket, svc: Service) -> None:
        self.ws = ws
        self.svc = svc
        self.session = Session(svc, self._wake_writer, client_of(ws))
        self._wake = asyncio.Event()
        self._space = asyncio.Event()  # clear while the session is backlogged
        self._space.set()
        extensions = ws.scope.get("extensions") or {}
        self._send_now = extensions.get(SEND_TEXT_NOW)  # Sluice's server only
        self._writing = False  # the writer task is sending: everything goes through it until it waits again
        self._unsent: list[ServerMessage] = []  # taken from the session, turned back by the socket: sent first
        # the client's share of the loop (service/budget.py), for the socket's decoding and, under Sluice's server,
        # its reads (their frames' parsing) and its handling until authenticated; every connection of the client
        # charges the same one. Released by `websocket_endpoint`.
        self._budget = svc.loop_budgets.hold(self.session.client)
        if (charge_to := extensions.get(CHARGE_TO)) is not None:
            charge_to(self._budget)

    def _wake_writer(self) -> None:
        """The session has output: written now where it can be (module docstring), else by the writer task."""
        if self.session.backlogged:
            self._space.clear()
        if self._send_now is None or self._writing or self._wake.is_set() or not self._write_now():
            self._wake.set()

    def _write_now(self) -> bool:
        """Sends what the session has, in the caller's turn; False if the writer is to take over: a frame the
        socket turned back (kept in `_unsent`), or a close. Anything raised must not reach the engine step's
        fan-out that called this: the connection closes with 1011 instead (a frame half written, or a chat's
        output half taken, cannot be sent again safely), as it did when the writer task met the same error."""
        try:
            while self.session.close_code is None and (frames := self.session.next_frames()):
                while frames and self._send_now(encode_utf8(frames[0])):  # False: its buffer is full, or it closes
                    frames.pop(0)
                if frames:
                    self._unsent = frames
                    return False
        except Exception:
            log.exception("writing to a websocket failed; closing it")
            self._unsent = []
            self.session.close(WS_1011_INTERNAL_ERROR)
            return False
        if not self.session.backlogged:
            self._space.set()
        return self.session.close_code is None  # the close is the writer's

    def shutdown(self, code: int = WS_1001_GOING_AWAY) -> None:
        """Flush what is pending, then close with `code`."""
        self.session.close(code)

    async def run(self) -> None:
        """Accept, authenticate (docs/protocol.md §2), then serve until the socket closes."""
        key = self.svc.config.api_key
        token = bearer_token(self.ws.headers)
        # NOTE: counted (in `connections` or `pending_auth`) before the first await, so a burst cannot overshoot
        if key is None or (token is not None and key_matches(token, key)):
            self.svc.connections.add(self, self.session.client)  # decided by the upgrade request: never waits
            stop_metering(self.ws.scope)  # (authenticated: its handshake and `ready` are not the client's to pay for)
            await self.ws.accept()
        elif token is not None:
            await self.ws.accept()
            await self._refuse("the API key in the Authorization header is wrong")
            return
        else:
            evicted = self.svc.pending_auth.admit(self)
            await self.ws.accept()
            if not await self._hello(key, evicted):
                return
        stop_metering(self.ws.scope)  # (from here each message's decoding is charged as it is read: `_read_loop`)
        writer = asyncio.create_task(self._write_loop())
        try:
            self.session.send(self.session.ready())
            await self._read_loop(writer)
        finally:
            writer.cancel()
            self.session.abort_all()

    # ---- reading ---------------------------------------------------------------------------
    async def _hello(self, key: str, evicted: asyncio.Event) -> bool:
        """Wait in `pending_auth` for the first frame, a `hello` with the key; then take a connection slot."""
        timeout = self.svc.config.timeout_auth
        receive = asyncio.ensure_future(self.ws.receive())
        pushed_out = asyncio.ensure_future(evicted.wait())
        try:
            done, _ = await asyncio.wait({receive, pushed_out}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pushed_out.cancel()
            receive.cancel()  # a no-op once it has its frame
            self.svc.pending_auth.leave(self)
        if receive not in done:
            if self.svc.draining:
                await self._close(WS_1001_GOING_AWAY)
                return False
            if evicted.is_set():
                return await self._refuse(f"{self.svc.config.max_pending_auth} newer sockets are waiting to "
                                          "authenticate (--max-pending-auth); reconnect and send `hello` at once",
                                          "overloaded", WS_1013_TRY_AGAIN_LATER)
            return await self._refuse(f"no `hello` within {timeout:g} s (--timeout-auth)")
        message = receive.result()
        if message["type"] == "websocket.disconnect":
            return False
        text = message.get("text") or b""  # (a binary frame is never a valid `hello`)
        # NOTE: a `hello` is small; a larger frame is refused unread: a client without the key gets no decoding of
        # costly frames (decoding is charged to the loop budget after `ready` only), however often it comes back
        if len(text) > (limit := HELLO_BYTES + 12 * len(key)):  # (a key's characters may each be an escaped pair)
            return await self._refuse(f"the first frame must be a `hello` (at most {limit} characters with this "
                                      "server's key); authenticate first")
        match decode_client(text):
            case Hello(api_key=presented) if key_matches(presented, key):
                pass
            case Hello():
                return await self._refuse("wrong API key in `hello`")
            case _:
                return await self._refuse('authenticate first: send {"type": "hello", "api_key": KEY} '
                                          "or the header `Authorization: Bearer KEY`")
        if (refusal := self.svc.connections.refusal(self.session.client)) is not None:
            return await self._refuse(refusal[1], "overloaded", WS_1013_TRY_AGAIN_LATER)
        self.svc.connections.add(self, self.session.client)
        return True

    async def _refuse(self, message: str, code: ErrorCode = "unauthorized",
                      close_code: int = WS_1008_POLICY_VIOLATION) -> bool:
        """Before `ready`: one `error` frame, then close."""
        log.info("websocket refused: %s", code)
        self.svc.metrics.observe_error(code)
        try:
            await self.ws.send_text(encode(Error(code=code, message=message)))
        except (WebSocketDisconnect, OSError, RuntimeError):
            return False
        await self._close(close_code, code)
        return False

    async def _close(self, code: int, reason: str = "") -> None:
        try:
            await self.ws.close(code, reason)
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass

    async def _read_loop(self, writer: asyncio.Task[None]) -> None:
        while not writer.done():
            if not self._space.is_set():
                await self._space.wait()
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            text = message.get("text")
            started = time.perf_counter()
            if text is None:
                self.session.receive(Error(code="invalid_message",
                                           message="binary frames are not accepted; send JSON as a text frame"))
            else:
                self.session.receive(decode_client(text))
            if (wait := self._budget.charge(time.perf_counter() - started)) > 0:
                await asyncio.sleep(wait)  # this client has had its share of the loop (service/budget.py)

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._writing = True
                self._wake.clear()
                while frames := self._unsent or self.session.next_frames():
                    self._unsent = []
                    for frame in frames:
                        await self.ws.send_text(encode(frame))
                    if not self.session.backlogged:
                        self._space.set()
                if self.session.close_code is not None:
                    await self.ws.close(self.session.close_code)
                    return
                self._writing = False
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass  # the socket is gone; the reader sees the disconnect and cleans up
        finally:
            self._space.set()


async def websocket_endpoint(websocket: WebSocket) -> None:
    svc: Service = websocket.app.state.service
    refusal: tuple[int, str] | None = None
    if not origin_allowed(websocket.headers, svc.config.allowed_origins):
        refusal = (403, "this Origin is not allowed (--allowed-origins)")
    elif not svc.accepting:
        refusal = (503, "the server is starting or shutting down; retry shortly")
    else:
        refusal = svc.connections.refusal(client_of(websocket))
    if refusal is not None:
        log.debug("websocket upgrade refused: %d %s", *refusal)  # uvicorn logs the status line at info
        try:
            headers = {"Retry-After": str(RETRY_AFTER_S[refusal[0]])} if refusal[0] in RETRY_AFTER_S else None
            await websocket.send_denial_response(PlainTextResponse(refusal[1], status_code=refusal[0], headers=headers))
        except RuntimeError:  # server without the denial-response extension: refuse by closing
            await websocket.close(WS_1008_POLICY_VIOLATION if refusal[0] == 403 else WS_1013_TRY_AGAIN_LATER)
        return
    conn = Connection(websocket, svc)
    svc.metrics.websocket_connections.inc()
    try:
        await conn.run()
    finally:
        svc.connections.discard(conn)
        svc.pending_auth.leave(conn)
        svc.loop_budgets.release(conn.session.client)
        svc.metrics.websocket_connections.dec()
