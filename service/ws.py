"""WebSocket endpoint `/v1/ws` (docs/protocol.md). Per connection: this task reads, one writer task
is the only sender. A chat's pending output is merged into one `delta` per writer pass, so a slow
reader gets bigger frames, never a growing queue; control replies are bounded by pausing the reader.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from starlette.responses import PlainTextResponse
from starlette.status import WS_1001_GOING_AWAY, WS_1008_POLICY_VIOLATION, WS_1013_TRY_AGAIN_LATER
from starlette.websockets import WebSocket, WebSocketDisconnect

from service.auth import bearer_token, key_matches, origin_allowed
from service.budget import LoopBudget
from service.handle import GenerateRequest, RequestError, RequestHandle
from service.protocol import (
    Cancel, Chat, Delta, Done, Error, ErrorCode, Hello, Ping, Pong, Ready, ServerMessage, Start, Stats,
    StatsRequest, Timing, Usage, decode_client, encode,
)

if TYPE_CHECKING:
    from service.app import Service

log = logging.getLogger("sluice.ws")

CONTROL_HIGH_WATER = 256  # queued replies (pong, stats, errors) before the reader stops reading
_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


class _Chat:
    __slots__ = ("id", "handle", "started", "carry_tokens")

    def __init__(self, chat_id: str) -> None:
        self.id = chat_id
        self.handle: RequestHandle | None = None
        self.started = False
        self.carry_tokens = 0  # tokens whose text the engine still withholds (split UTF-8, stop prefix)


class Connection:
    def __init__(self, ws: WebSocket, svc: Service) -> None:
        self.ws = ws
        self.svc = svc
        self.chats: dict[str, _Chat] = {}  # in flight: until its done/error frame is sent
        self._control: deque[ServerMessage] = deque()
        self._dirty: dict[str, _Chat] = {}  # insertion-ordered set of chats with output to send
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._budget = LoopBudget()
        self._space.set()
        self._close_code: int | None = None

    def shutdown(self, code: int = 1001) -> None:
        """Ask the writer to flush what is pending, then close with `code`."""
        self._close_code = code
        self._wake.set()

    async def run(self) -> None:
        """Accept, authenticate (docs/protocol.md §2), then serve until the socket closes."""
        key = self.svc.config.api_key
        token = bearer_token(self.ws.headers)
        # NOTE: counted (in `connections` or `pending_auth`) before the first await, so a burst cannot overshoot
        if key is None or (token is not None and key_matches(token, key)):
            self.svc.connections.add(self)  # decided by the upgrade request: never waits
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
        writer = asyncio.create_task(self._write_loop())
        try:
            self._send(self._ready())
            await self._read_loop(writer)
        finally:
            writer.cancel()
            for chat in self.chats.values():  # NOTE: a closed socket frees its KV cache now
                if chat.handle is not None:
                    self.svc.bridge.abort(chat.handle)

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
        match decode_client(message.get("text") or b""):  # a binary frame is never a valid `hello`
            case Hello(api_key=presented) if key_matches(presented, key):
                pass
            case Hello():
                return await self._refuse("wrong API key in `hello`")
            case _:
                return await self._refuse('authenticate first: send {"type": "hello", "api_key": KEY} '
                                          "or the header `Authorization: Bearer KEY`")
        cap = self.svc.config.max_connections
        if cap is not None and len(self.svc.connections) >= cap:
            return await self._refuse(f"all {cap} connections are in use (--max-connections); retry later",
                                      "overloaded", WS_1013_TRY_AGAIN_LATER)
        self.svc.connections.add(self)
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
            if self._close_code is not None:
                continue  # closing: nothing the client sends now starts anything
            text = message.get("text")
            if text is None:
                self._error("invalid_message", "binary frames are not accepted; send JSON as a text frame")
                continue
            started = time.perf_counter()
            self._handle(decode_client(text))
            if (wait := self._budget.charge(time.perf_counter() - started)) > 0:
                await asyncio.sleep(wait)  # this connection has had its share of the loop (service/budget.py)

    def _handle(self, msg: object) -> None:
        match msg:
            case Chat():
                self._start_chat(msg)
            case Cancel(id=chat_id):
                chat = self.chats.get(chat_id)
                if chat is None:
                    self._error("unknown_id", f"no chat {chat_id!r} is in flight on this connection")
                elif chat.handle is not None:
                    self.svc.bridge.abort(chat.handle)
            case Ping(data=data):
                self._send(Pong(data=data))
            case StatsRequest():
                self._send(self._stats())
            case Hello(api_key=presented):  # already authenticated (or no key set)
                key = self.svc.config.api_key
                if key is None or key_matches(presented, key):
                    self._send(self._ready())
                else:
                    log.info("websocket closed: wrong API key in a later `hello`")
                    self._error("unauthorized", "wrong API key in `hello`; closing")
                    self.shutdown(WS_1008_POLICY_VIOLATION)
            case Error(id=chat_id) if chat_id is not None and chat_id in self.chats:
                # NOTE: an id in flight must not see a second terminal message; report it frame-level
                self._error(msg.code, f"(frame for in-flight id {chat_id!r}) {msg.message}")
            case Error():
                self._error(msg.code, msg.message, msg.id)

    def _start_chat(self, msg: Chat) -> None:
        if msg.id in self.chats:
            self._error("duplicate_id", f"chat {msg.id!r} is already in flight on this connection; "
                                        "use a new id or wait for its done")
            return
        cap = self.svc.config.max_inflight_per_connection
        if len(self.chats) >= cap:
            self._error("too_many_inflight", f"this connection already has {cap} chats in flight "
                                              "(the per-connection limit); wait for one to finish", msg.id)
            return
        if self.svc.draining:
            self._error("overloaded", "the server is shutting down; reconnect later", msg.id)
            return
        chat = _Chat(msg.id)
        request = GenerateRequest(prompt=msg.messages, chat=True, sampling=msg.sampling_kwargs(),
                                  max_tokens=msg.max_tokens, api="ws")
        try:
            chat.handle = self.svc.bridge.submit(request, lambda: self._mark(chat))
        except RequestError as e:
            self._error(e.code, e.message, msg.id)
            return
        self.chats[msg.id] = chat

    # ---- writing ---------------------------------------------------------------------------
    def _send(self, msg: ServerMessage) -> None:
        self._control.append(msg)
        if len(self._control) >= CONTROL_HIGH_WATER:
            self._space.clear()
        self._wake.set()

    def _error(self, code: str, message: str, chat_id: str | None = None) -> None:
        self.svc.metrics.observe_error(code)
        self._send(Error(code=code, message=message, id=chat_id))  # type: ignore[arg-type]

    def _mark(self, chat: _Chat) -> None:
        self._dirty[chat.id] = chat
        self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._control or self._dirty:
                    while self._control:
                        await self.ws.send_text(encode(self._control.popleft()))
                    self._space.set()
                    if self._dirty:
                        chat_id = next(iter(self._dirty))
                        for frame in self._frames(self._dirty.pop(chat_id)):
                            await self.ws.send_text(encode(frame))
                if self._close_code is not None:
                    await self.ws.close(self._close_code)
                    return
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass  # the socket is gone; the reader sees the disconnect and cleans up
        finally:
            self._space.set()

    def _frames(self, chat: _Chat) -> list[ServerMessage]:
        """What is pending for one chat, merged: [start] [delta] [done | error]."""
        h = chat.handle
        assert h is not None
        frames: list[ServerMessage] = []
        if not chat.started and h.prompt_tokens is not None:
            chat.started = True
            frames.append(Start(id=chat.id, prompt_tokens=h.prompt_tokens, cached_tokens=h.cached_tokens))
        text, tokens, _ = h.take()
        chat.carry_tokens += tokens
        if text:
            frames.append(Delta(id=chat.id, text=text, tokens=chat.carry_tokens))
            chat.carry_tokens = 0
        if h.finished:
            del self.chats[chat.id]
            if h.error is not None:
                self.svc.metrics.observe_error(h.error.code)
                frames.append(Error(code=h.error.code, message=h.error.message, id=chat.id))  # type: ignore[arg-type]
            else:
                q, ttft, total = h.timing_ms()
                frames.append(Done(id=chat.id, finish_reason=_FINISH.get(h.finish_reason or "", "stop"),
                                   usage=Usage(prompt_tokens=h.prompt_tokens or 0,
                                               completion_tokens=h.completion_tokens, cached_tokens=h.cached_tokens),
                                   timing=Timing(queue_ms=round(q, 3), ttft_ms=None if ttft is None else round(ttft, 3),
                                                 total_ms=round(total, 3))))
        return frames

    def _ready(self) -> Ready:
        return Ready(model=self.svc.model_name, max_model_len=self.svc.bridge.max_model_len,
                     max_inflight=self.svc.config.max_inflight_per_connection)

    def _stats(self) -> Stats:
        s, b = self.svc.bridge.stats, self.svc.bridge
        queries = int(s.get("prefix_cache_queries", 0))
        hits = int(s.get("prefix_cache_hits", 0))
        return Stats(
            num_running=int(s.get("num_running", 0)), num_waiting=int(s.get("num_waiting", 0)),
            num_kv_blocks=int(s.get("num_kv_blocks", 0)), num_free_kv_blocks=int(s.get("num_free_kv_blocks", 0)),
            kv_usage=float(s.get("kv_usage", 0.0)), prefix_cache_queries=queries, prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            num_preemptions=int(s.get("num_preemptions", 0)), num_steps=int(s.get("num_steps", 0)),
            prompt_tokens_computed=int(s.get("prompt_tokens_computed", 0)),
            generation_tokens=int(s.get("generation_tokens", 0)),
            generation_tokens_per_s=round(b.generation_tokens_per_s(), 3),
            connections=len(self.svc.connections), requests_in_flight=b.num_in_flight)


async def websocket_endpoint(websocket: WebSocket) -> None:
    svc: Service = websocket.app.state.service
    refusal: tuple[int, str] | None = None
    if not origin_allowed(websocket.headers, svc.config.allowed_origins):
        refusal = (403, "this Origin is not allowed (--allowed-origins)")
    elif not svc.accepting:
        refusal = (503, "the server is starting or shutting down; retry shortly")
    elif svc.config.max_connections is not None and len(svc.connections) >= svc.config.max_connections:
        refusal = (503, f"too many connections (limit {svc.config.max_connections}); retry later")
    if refusal is not None:
        log.debug("websocket upgrade refused: %d %s", *refusal)  # uvicorn logs the status line at info
        try:
            await websocket.send_denial_response(PlainTextResponse(refusal[1], status_code=refusal[0]))
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
        svc.metrics.websocket_connections.dec()
