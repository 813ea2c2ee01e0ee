"""One WebSocket connection's protocol, without I/O (docs/protocol.md): decoded client frames in, server
messages out. `service/ws.py` owns the socket, authentication and the reader/writer tasks around it.

Output waits here until the writer asks for it: control replies (pong, stats, errors) in order, and per chat
whatever its handle holds, merged into at most one start, one delta and one done/error per writer pass, so a
slow reader gets bigger frames, never a growing queue.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.status import WS_1008_POLICY_VIOLATION

from engine import InvalidSamplingParam
from service.auth import key_matches
from service.handle import GenerateRequest, RequestError, RequestHandle, sampling_params
from service.openai_reasoning import ThinkStream, after_reasoning
from service.protocol import (
    Cancel, Chat, Delta, Done, Error, ErrorCode, FinishReason, Hello, Ping, Pong, Ready, ServerMessage, Start,
    Stats, StatsRequest, Timing, Usage,
)

if TYPE_CHECKING:
    from service.state import Service

log = logging.getLogger("sluice.ws")

CONTROL_HIGH_WATER = 256  # queued control replies before the connection stops reading
CONTROL_HIGH_WATER_BYTES = 4 << 20  # or queued pong data (each up to a frame's size: 256 of them could be 256 MB)
FINISH_REASON: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "cancelled"}  # engine -> ws


class _Chat:
    __slots__ = ("id", "handle", "start_sent", "carry_tokens", "think")

    def __init__(self, chat_id: str, handle: RequestHandle, think: ThinkStream | None = None) -> None:
        self.id = chat_id
        self.handle = handle
        self.start_sent = False
        self.carry_tokens = 0  # tokens whose text the engine still withholds (split UTF-8, stop prefix)
        self.think = think  # `--reasoning-parser`: the answer's reasoning apart from its text


class Session:
    """`receive` each client frame; `wake` is called whenever `next_frames` has something new."""

    def __init__(self, svc: Service, wake: Callable[[], None], client: str | None = None) -> None:
        """`client`: the peer's address (`GenerateRequest.client`)."""
        self.svc = svc
        self.wake = wake
        self.client = client
        self.chats: dict[str, _Chat] = {}  # in flight: until its done/error frame is taken
        self.close_code: int | None = None  # set: send what is pending, then close with this code
        self._control: deque[ServerMessage] = deque()
        self._control_bytes = 0  # of the pongs' data in `_control`
        self._dirty: dict[str, _Chat] = {}  # insertion-ordered set of chats with output to send

    @property
    def backlogged(self) -> bool:
        """Too many control replies unsent, or too many bytes of them: stop reading until the writer catches up."""
        return len(self._control) >= CONTROL_HIGH_WATER or self._control_bytes >= CONTROL_HIGH_WATER_BYTES

    def close(self, code: int) -> None:
        """Send what is pending, then close with `code`; frames received meanwhile are ignored."""
        self.close_code = code
        self.wake()

    def abort_all(self) -> None:
        """The socket is gone: stop every chat in flight (frees its KV cache now)."""
        for chat in self.chats.values():
            self.svc.bridge.abort(chat.handle)

    # ---- frames in ---------------------------------------------------------------------------
    def receive(self, msg: object) -> None:
        if self.close_code is not None:
            return  # closing: nothing the client sends now starts anything
        match msg:
            case Chat():
                self._start_chat(msg)
            case Cancel(id=chat_id):
                chat = self.chats.get(chat_id)
                if chat is None:
                    self.error("unknown_id", f"no chat {chat_id!r} is in flight on this connection")
                else:
                    self.svc.bridge.abort(chat.handle)
            case Ping(data=data):
                self._control_bytes += len(data)
                self.send(Pong(data=data))
            case StatsRequest():
                self.send(self.stats())
            case Hello(api_key=presented):  # already authenticated (or no key set)
                key = self.svc.config.api_key
                if key is None or key_matches(presented, key):
                    self.send(self.ready())
                else:
                    log.info("websocket closed: wrong API key in a later `hello`")
                    self.error("unauthorized", "wrong API key in `hello`; closing")
                    self.close(WS_1008_POLICY_VIOLATION)
            case Error(id=chat_id) if chat_id is not None and chat_id in self.chats:
                # NOTE: an id in flight must not see a second terminal message; report it frame-level
                self.error(msg.code, f"(frame for in-flight id {chat_id!r}) {msg.message}")
            case Error():
                self.error(msg.code, msg.message, msg.id)

    def _start_chat(self, msg: Chat) -> None:
        if msg.id in self.chats:
            self.error("duplicate_id", f"chat {msg.id!r} is already in flight on this connection; "
                                       "use a new id or wait for its done")
            return
        cap = self.svc.config.max_inflight_per_connection
        if len(self.chats) >= cap:
            self.error("too_many_inflight", f"this connection already has {cap} chats in flight "
                                            "(the per-connection limit); wait for one to finish", msg.id)
            return
        if self.svc.draining:
            self.error("overloaded", "the server is shutting down; reconnect later", msg.id)
            return
        try:
            kwargs = msg.sampling_kwargs()
            if (so := kwargs.get("structured_output")) is not None:  # (a reasoning model's reasoning: free)
                kwargs["structured_output"] = after_reasoning(self.svc.config.reasoning_parser, so)
            params = sampling_params(self.svc.bridge.sampling_defaults, max_tokens=msg.max_tokens, **kwargs)
            request = GenerateRequest(prompt=msg.messages, chat=True, params=params, api="ws", client=self.client)
            # NOTE: the bridge never notifies inside `submit`, so the chat is registered below before its first mark
            handle = self.svc.bridge.submit(request, lambda: self._mark(msg.id))
        except RequestError as e:
            self.error(e.code, e.message, msg.id)
            return
        except InvalidSamplingParam as e:  # (a `response_format` it cannot take)
            self.error("invalid_message", str(e), msg.id)
            return
        parser, so = self.svc.config.reasoning_parser, params.structured_output
        # (an answer held to a grammar from its first token: not opened)
        think = ThinkStream(parser, opened=so is None or bool(so.after)) if parser is not None else None
        self.chats[msg.id] = _Chat(msg.id, handle, think)

    # ---- messages out ------------------------------------------------------------------------
    def send(self, msg: ServerMessage) -> None:
        self._control.append(msg)
        self.wake()

    def error(self, code: ErrorCode, message: str, chat_id: str | None = None) -> None:
        self.svc.metrics.observe_error(code)
        self.send(Error(code=code, message=message, id=chat_id))

    def _mark(self, chat_id: str) -> None:
        if (chat := self.chats.get(chat_id)) is not None:
            self._dirty[chat_id] = chat
            self.wake()

    def next_frames(self) -> list[ServerMessage]:
        """What to send next: every control reply, else one chat's pending output; [] when there is nothing."""
        if self._control:
            frames = list(self._control)
            self._control.clear()
            self._control_bytes = 0
            return frames
        while self._dirty:
            chat = self._dirty.pop(next(iter(self._dirty)))
            if frames := self._frames(chat):
                return frames
        return []

    def _frames(self, chat: _Chat) -> list[ServerMessage]:
        """What is pending for one chat, merged: [start] [delta] [done | error]."""
        h = chat.handle
        frames: list[ServerMessage] = []
        if not chat.start_sent and h.started:
            chat.start_sent = True
            frames.append(Start(id=chat.id, prompt_tokens=h.prompt_tokens or 0, cached_tokens=h.cached_tokens))
        text, tokens, _ = h.take()
        chat.carry_tokens += tokens
        reasoning = ""
        if chat.think is not None:
            parts = chat.think.feed(text) + (chat.think.end() if h.finished else [])
            text = "".join(t for kind, t, _ in parts if kind == "content")
            reasoning = "".join(t for kind, t, _ in parts if kind == "reasoning")
        if text or reasoning:
            frames.append(Delta(id=chat.id, text=text, tokens=chat.carry_tokens, reasoning=reasoning))
            chat.carry_tokens = 0
        if h.finished:
            del self.chats[chat.id]
            if h.error is not None:
                self.svc.metrics.observe_error(h.error.code)
                frames.append(Error(code=h.error.code, message=h.error.message, id=chat.id))
            else:
                q, ttft, total = h.timing_ms()
                frames.append(Done(id=chat.id, finish_reason=FINISH_REASON.get(h.finish_reason or "", "stop"),
                                   usage=Usage(prompt_tokens=h.prompt_tokens or 0,
                                               completion_tokens=h.completion_tokens, cached_tokens=h.cached_tokens),
                                   timing=Timing(queue_ms=round(q, 3), ttft_ms=None if ttft is None else round(ttft, 3),
                                                 total_ms=round(total, 3))))
        return frames

    def ready(self) -> Ready:
        return Ready(model=self.svc.model_name, max_model_len=self.svc.bridge.max_model_len,
                     max_inflight=self.svc.config.max_inflight_per_connection,
                     defaults=dict(self.svc.bridge.sampling_defaults))

    def stats(self) -> Stats:
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
