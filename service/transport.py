"""uvicorn's protocol classes with Sluice's connection guards (docs/protocol.md §8).

HTTP (h11): a request head must be whole within `--timeout-headers` of the connection going idle, a body
may pause at most `--timeout-body`, a response whose client takes none of it at most `--timeout-send`, and at
most `--max-http-connections` are open (a WebSocket leaves the count at its upgrade). At the bound, the
connection that has waited longest on its client (for a head, a body, or to read its response) is closed to
make room; only when every one is running a request does a new one get 503. The loop time its reads take is
charged to its peer's budget (service/budget.py), as are its making and its end, and the app's handling of each
request until the engine has it (`Metered`); a peer that has spent it is read no more, nor is its next pipelined
request begun, for a while. A request with both Content-Length and Transfer-Encoding is refused (400, closed), and
a target in absolute form (`GET http://host/path`) is routed by its path (RFC 9112 §6.3, §3.2.2).
WebSocket (websockets-sansio): neither an upgrade refused with a denial response nor a text frame that is
not UTF-8 is logged as an error, and each upgrade gets uvicorn's one log line, not websockets' own besides.
The loop time spent on a socket's reads (parsing its frames, answering its pings) is charged to its client's
`LoopBudget` (service/budget.py; service/ws.py names it, and charges its decoding to it as well).
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import sys
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, ClassVar, Literal

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # (uvicorn imports it so too)
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_client_addr
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.frames import Frame

from service.budget import METER, LoopBudget, PeerBudgets, metered
from service.handle import client_key
from service.openai_api import error_response

log = logging.getLogger("sluice.transport")
# the ASGI scope extensions under which SluiceWebSocketProtocol offers `send_text_now` and `charge_to`
# (service/ws.py uses them)
SEND_TEXT_NOW = "sluice.send_text_now"
CHARGE_TO = "sluice.charge_to"

# Where a connection is: waiting on its client for a request head or the rest of a body, or for it to read the
# response (the socket's write buffer is over its high water mark), or the app answers.
Phase = Literal["head", "body", "send", "busy"]


class HttpGuard:
    """One server's open HTTP connections and their deadlines (the flags of the same names)."""

    def __init__(self, timeout_headers: float, timeout_body: float, timeout_send: float, max_connections: int,
                 budgets: PeerBudgets | None = None) -> None:
        assert timeout_headers > 0 and timeout_body > 0 and timeout_send > 0 and max_connections >= 1
        self.timeout_headers = timeout_headers
        self.timeout_body = timeout_body
        self.timeout_send = timeout_send
        self.max_connections = max_connections
        self.budgets = budgets if budgets is not None else PeerBudgets()  # loop time per peer: reads, handling
        self._waiting: dict[GuardedH11Protocol, None] = {}  # on their client, longest-waiting first
        self._busy: set[GuardedH11Protocol] = set()

    def __len__(self) -> int:
        return len(self._waiting) + len(self._busy)

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Count a new connection, at the bound evicting the longest-waiting one; False: every one is busy."""
        if len(self) >= self.max_connections:
            if not self._waiting:
                return False
            oldest = next(iter(self._waiting))
            self.leave(oldest)
            oldest.evict()
        self._waiting[conn] = None
        return True

    def enter(self, conn: GuardedH11Protocol, phase: Phase) -> None:
        self.leave(conn)
        if phase == "busy":
            self._busy.add(conn)
        else:
            self._waiting[conn] = None  # to the back: its wait starts now

    def leave(self, conn: GuardedH11Protocol) -> None:
        self._waiting.pop(conn, None)
        self._busy.discard(conn)

    def protocol(self) -> type[GuardedH11Protocol]:
        """The class to give uvicorn as `http`: `GuardedH11Protocol` bound to this guard."""

        class Bound(GuardedH11Protocol):
            pass

        Bound.guard = self
        return Bound


def _head_bytes(request: h11.Request) -> int:
    """About the bytes of a request head as sent: the request line and each `name: value` line."""
    return (len(request.method) + len(request.target) + 11
            + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()))


def _raw_response(status: int, message: str, code: str, type_: str | None = None) -> bytes:
    """A whole `connection: close` response in OpenAI's error shape, written past h11 (which has no request
    to answer before a head is whole)."""
    response = error_response(status, message, type_, code=code)
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in response.raw_headers]
    lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + bytes(response.body)


_TCPI_BYTES_ACKED = slice(120, 128)  # where Linux's struct tcp_info has tcpi_bytes_acked (a u64, since 4.1)
_REQUEST_ENDED = (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL)  # h11 parses no more of the client's until the response ends
_ABSOLUTE_FORM = re.compile(rb"https?://[^/?#]*", re.IGNORECASE)  # a request target's scheme and authority
READ_SLICE = 16 << 10  # bytes of a read parsed at once: at most ~20 ms of loop time, however tiny the frames


class _ChargedReads:
    """A socket's reads, parsed a slice at a time, each slice's loop time charged to a `LoopBudget`.

    A read is up to 256 KiB; of 1-byte body chunks or empty WebSocket pings that is ~40,000 events, ~0.3 s of
    the loop in one go, and a client that keeps sending them ran the loop flat out without making one request or
    message for the app to charge. Here the protocol gets `READ_SLICE` bytes at a time, and none while the budget
    is spent: the rest of the read waits and the socket is not read until the budget has refilled (TCP then holds
    the client back). Ordinary reads are one slice, parsed at once.
    """

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def _init_reads(self) -> None:
        self._backlog = b""  # read, not yet parsed: what is left of one read
        self._budget_wait: asyncio.TimerHandle | None = None  # until the budget has refilled
        self._holding = False  # reading paused here (uvicorn pauses and resumes for reasons of its own besides)

    def _parse(self, data: bytes) -> None:
        raise NotImplementedError  # the protocol's own `data_received`

    def _charge(self, seconds: float) -> float:
        raise NotImplementedError  # the budget's `charge`

    def _may_parse(self) -> bool:
        return True

    def _uvicorn_paused(self) -> bool:
        raise NotImplementedError  # uvicorn's own reason not to read

    def _gone(self) -> bool:
        return self.transport.is_closing()

    def _take(self, data: bytes) -> None:
        self._backlog = self._backlog + data if self._backlog else data
        self._feed()

    def _feed(self) -> None:
        while self._backlog and self._budget_wait is None and self._may_parse() and not self._gone():
            if self._spent():  # (by this connection, or by its peer's others: a new one too waits its turn)
                break
            piece, self._backlog = self._backlog[:READ_SLICE], self._backlog[READ_SLICE:]
            started = time.perf_counter()
            self._parse(piece)
            self._charge(time.perf_counter() - started)
        if self._gone():
            self._stop_reads()
            return
        if self._backlog or self._budget_wait is not None or not self._may_parse():
            self._holding = True
            self.transport.pause_reading()  # (again, if uvicorn has resumed it meanwhile)
        elif self._holding:
            self._holding = False
            if not self._uvicorn_paused():
                self.transport.resume_reading()

    def _spent(self) -> bool:
        """Whether the budget is spent; if so, `_refilled` is called once it has refilled."""
        if (wait := self._charge(0.0)) <= 0:
            return False
        self._budget_wait = self.loop.call_later(wait, self._refilled)
        return True

    def _refilled(self) -> None:
        self._budget_wait = None
        self._feed()

    def _stop_reads(self) -> None:
        self._backlog = b""
        if self._budget_wait is not None:
            self._budget_wait.cancel()
            self._budget_wait = None


class GuardedH11Protocol(_ChargedReads, H11Protocol):
    guard: ClassVar[HttpGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._born = time.perf_counter()  # (making and setting up a connection is charged to its peer)
        super().__init__(*args, **kwargs)
        self._phase: Phase | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None  # while bytes wait on the client (`_watch_send`)
        self._taken_at = 0  # `_taken()` when that deadline was set
        self._upgraded = False
        self._init_reads()
        # h11 bounds a head only while it is still arriving (its incomplete-event buffer): one that comes whole in a
        # single read of up to 64 KB would pass. Checked here on every head, whole: uvicorn answers 400 and closes.
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # (uvicorn's rule)
        next_event = self.conn.next_event

        def bounded_next_event() -> Any:
            event = next_event()
            if isinstance(event, h11.Request):
                if _head_bytes(event) > limit:
                    log.info("%s: a request head of %d bytes, over %d: 400", self._peer, _head_bytes(event), limit)
                    raise h11.RemoteProtocolError(f"request head over {limit} bytes")
                if {b"content-length", b"transfer-encoding"} <= {name for name, _ in event.headers}:
                    # RFC 9112 §6.3: a server must close the connection after such a request (h11 read its body by
                    # Transfer-Encoding and kept the connection: what a proxy going by Content-Length took for the
                    # body was a request here, smuggled past it). Refused: 400, closed.
                    log.info("%s: a request with both Content-Length and Transfer-Encoding: 400", self._peer)
                    raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding")
                if event.target[:1] != b"/" and (origin := _ABSOLUTE_FORM.match(event.target)):
                    # RFC 9112 §3.2.2: a server must accept a target in absolute form; routed by its path
                    path = event.target[origin.end():]
                    event = h11.Request(method=event.method, target=path if path[:1] == b"/" else b"/" + path,
                                        headers=event.headers, http_version=event.http_version)
            return event

        self.conn.next_event = bounded_next_event  # type: ignore[method-assign]
        self._done = False  # upgraded, refused or closed by the guard: nothing more to follow
        self.app = metered(self.app, self._charge)  # (its time charged to the peer's budget)

    @property
    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "?"

    def _request_line(self) -> str:
        return f"{self.scope['method']} {self.scope['path']}" if self.scope else "-"

    # ---- uvicorn's protocol, followed ------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        try:
            if not self.guard.admit(self):
                log.info("%s: refused: all %d HTTP connections are running requests (--max-http-connections): 503",
                         self._peer, self.guard.max_connections)
                self._done = True
                self.transport.write(_raw_response(
                    503, f"all {self.guard.max_connections} HTTP connections are in use; retry shortly",
                    "too_many_connections"))
                self.transport.close()
                return
            # uvicorn arms its keep-alive timer only after a response: a connection never sending a byte gets it too
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
            self._follow()
        finally:  # (its making, from its protocol's: a client opening one per request spent it uncharged)
            self._charge(time.perf_counter() - self._born)

    def connection_lost(self, exc: Exception | None) -> None:
        started = time.perf_counter()
        self._set_deadline(None)
        self._stop_send_deadline()
        self._stop_reads()
        self.guard.leave(self)
        if not self._done and self._phase == "body" and self.cycle is not None and not self.cycle.response_complete:
            log.info("%s: %s: the client closed the connection before sending the whole body",
                     self._peer, self._request_line())
        super().connection_lost(exc)
        self._charge(time.perf_counter() - started)

    def data_received(self, data: bytes) -> None:
        self._take(data)
        self._follow(data_arrived=True)

    # ---- its reads, charged to the peer's budget (_ChargedReads) ---------------------------------
    def _parse(self, data: bytes) -> None:
        super().data_received(data)

    @property
    def _budget_key(self) -> str:
        return client_key(self.client[0]) if self.client else "-"

    def _charge(self, seconds: float) -> float:
        return self.guard.budgets.charge(self._budget_key, seconds)

    def _uvicorn_paused(self) -> bool:
        return self.flow.read_paused

    def _gone(self) -> bool:
        return self._upgraded or self.transport.is_closing()  # (a client sends nothing before the upgrade's 101)

    def _may_parse(self) -> bool:
        # h11 parses nothing past a request's end until its response is complete: bytes read meanwhile (a pipelined
        # request, its body) wait in the backlog, to be parsed a slice at a time and charged (fed to h11, a whole
        # read of them was parsed at once when the response completed, ~0.3 s of 1-byte chunks, and uncharged once
        # the engine had the request). With nothing read, reads go on: a client's hang-up is seen (its request stopped;
        # one behind held bytes is seen when the response is written, as uvicorn's own pause has it). A request with an
        # `Upgrade` header that is not a WebSocket's is answered as any other, from MIGHT_SWITCH_PROTOCOL
        return self.conn.their_state not in _REQUEST_ENDED or not self._backlog

    def _refilled(self) -> None:
        super()._refilled()
        if self._budget_wait is None and not self._gone() and self.conn.our_state is self.conn.their_state is h11.IDLE:
            started = time.perf_counter()
            self.handle_events()  # (a pipelined request waiting in h11's buffer: the rest of a slice, at most)
            self._charge(time.perf_counter() - started)
            self._feed()
        self._follow()  # (what the held bytes were: a head, a body's end)

    def handle_events(self) -> None:
        """uvicorn's, which also begins the next pipelined request once a response is complete (from h11's buffer,
        read earlier): while the peer's budget is spent, that request waits as held reads do."""
        if self._budget_wait is not None or (not self._gone() and self._spent()):
            self._holding = True
            self.transport.pause_reading()
            return
        super().handle_events()

    def on_response_complete(self) -> None:
        meter = self.scope.get(METER) if self.scope else None
        started = time.perf_counter()
        super().on_response_complete()  # (uvicorn's begins a pipelined request in h11's buffer: the rest of a slice)
        if meter is None or not meter.metering:
            self._charge(time.perf_counter() - started)
            self._feed()  # what was read while the request ran, a slice at a time
        else:  # (this is its request's step, which the meter charges: the slices, charged each, come after it)
            self.loop.call_soon(self._feed)
        self._follow()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._follow()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._follow()

    def timeout_keep_alive_handler(self) -> None:
        if self._holding:  # the server is not reading (the peer's budget): what waits unread may be a request
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()
        self._watch_send()

    def shutdown(self) -> None:
        """uvicorn lets a request still sending its body run on, and cancels it (a traceback at ERROR) after its
        graceful timeout; a body the server will not serve is refused now."""
        if self._phase == "body" and not self._done:
            log.info("%s: %s: the server is shutting down before the body was whole: 503", self._peer,
                     self._request_line())
            self._close(_raw_response(503, "the server is shutting down; retry", "service_unavailable"))
            return
        super().shutdown()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._set_deadline(None)
        self._stop_send_deadline()
        self._upgraded = True
        self._stop_reads()
        if self._holding:  # the socket is the WebSocket's to read now, by its own budget
            self._holding = False
            self.transport.resume_reading()
        self.guard.leave(self)  # WebSockets are bounded by --max-connections and --max-pending-auth
        self._done = True
        super().handle_websocket_upgrade(event)
        if isinstance(ws := self.transport.get_protocol(), SluiceWebSocketProtocol):
            # its reads and its app's handling (an upgrade refused costs the loop too) are this peer's until the app
            # names the client's: a new socket has no burst of its own
            ws.charge_to(self.guard.budgets.budget(self._budget_key))

    # ---- the guard -------------------------------------------------------------------------------
    def _follow(self, data_arrived: bool = False) -> None:
        """Track h11's state: which deadline runs, and whether the guard may evict this connection."""
        self._watch_send()
        if self._done or self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY and self.conn.our_state in (h11.DONE, h11.MUST_CLOSE):
            # answered (413, 401, 403, ...) before the body was whole: the rest is for nobody, and a client
            # trickling it would keep the connection forever
            log.info("%s: %s: answered before its body was whole: closed", self._peer, self._request_line())
            self._close()
            return
        if self.conn.their_state is h11.SEND_BODY:
            phase: Phase = "body"
        elif self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            phase = "head"
        else:
            phase = "send" if self.flow.write_paused else "busy"
        if phase != self._phase:
            self._phase = phase
            self.guard.enter(self, phase)
        elif not (phase == "body" and data_arrived):
            return  # a head's deadline runs from its start; only a body's restarts with each byte
        if phase == "head":
            self._set_deadline(self.guard.timeout_headers, self._head_timeout)
        elif phase == "body":
            self._set_deadline(self.guard.timeout_body, self._body_timeout)
        else:
            self._set_deadline(None)

    def _set_deadline(self, delay: float | None, callback: Callable[[], None] | None = None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None if delay is None or callback is None else self.loop.call_later(delay, callback)

    def _watch_send(self) -> None:
        """Bytes waiting on the client, that the socket may never take: a response over the write buffer's high water
        mark (uvicorn's flow control then holds the app), or a closing connection's last output (`transport.close()`
        waits for it to be sent). The client must take some every `--timeout-send`, else the connection is dropped;
        without, a client that reads nothing held its connection, its slot and its request for ever."""
        if self._upgraded:
            return
        if not self._stalled():
            self._stop_send_deadline()
        elif self._send_deadline is None:
            self._taken_at = self._taken()
            self._send_deadline = self.loop.call_later(self.guard.timeout_send, self._send_timeout)

    def _stalled(self) -> bool:
        return bool(self.transport.get_write_buffer_size()) and (self.flow.write_paused or self.transport.is_closing())

    def _taken(self) -> int:
        """How much of the output the client has taken so far: the bytes its TCP acknowledged (Linux's TCP_INFO), else
        minus the bytes still unsent here. (The write buffer alone moves too coarsely: the kernel takes more of it
        only once a third of its own, up to 4 MB, is free, so a client reading a steady 25 KB/s looked stalled.)"""
        sock = self.transport.get_extra_info("socket")
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES_ACKED.stop)
            if len(info) >= _TCPI_BYTES_ACKED.stop:
                return int.from_bytes(info[_TCPI_BYTES_ACKED], sys.byteorder)
        except (AttributeError, OSError):
            pass
        return -self.transport.get_write_buffer_size()

    def _stop_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_timeout(self) -> None:
        self._send_deadline = None
        if self._taken() > self._taken_at or not self._stalled():  # the client took some: a new period
            self._watch_send()
            return
        log.info("%s: %s: the client took none of the response for %g s (--timeout-send): dropped", self._peer,
                 self._request_line(), self.guard.timeout_send)
        self._drop()

    def _drop(self) -> None:
        """Closed now, unsent bytes and all; the app, if running, reads a disconnect (uvicorn's `connection_lost`)."""
        self._done = True
        self._set_deadline(None)
        self._stop_send_deadline()
        self.transport.abort()

    def _head_timeout(self) -> None:
        if self._holding:  # as the body's: the server's wait, not the client's
            self._set_deadline(self.guard.timeout_headers, self._head_timeout)
            return
        if not self._has_partial_request():
            self._close()  # idle: nothing to say
            return
        limit = self.guard.timeout_headers
        log.info("%s: no whole request head within %g s (--timeout-headers): 408", self._peer, limit)
        self._close(_raw_response(408, f"no whole request head within {limit:g} s", "request_timeout",
                                  "invalid_request_error"))

    def _body_timeout(self) -> None:
        limit = self.guard.timeout_body
        if self.flow.read_paused or self._holding:  # the server's wait, not the client's
            self._set_deadline(limit, self._body_timeout)
            return
        log.info("%s: %s: request body idle for %g s (--timeout-body): closed", self._peer, self._request_line(), limit)
        self._close(_raw_response(408, f"the request body stopped for {limit:g} s", "request_timeout",
                                  "invalid_request_error"))

    def evict(self) -> None:
        """Closed to make room for a new connection; the guard has already stopped counting it, so nothing of it may
        linger: output the client has not taken is dropped with it."""
        if self._phase == "send":
            log.info("%s: %s: closed while its client was not reading the response, to make room "
                     "(--max-http-connections %d)", self._peer, self._request_line(), self.guard.max_connections)
            self._drop()
            return
        if self.transport.get_write_buffer_size():
            log.debug("%s: idle connection with output unread closed to make room (--max-http-connections)", self._peer)
            self._drop()
            return
        if not self._has_partial_request():
            log.debug("%s: idle connection closed to make room (--max-http-connections)", self._peer)
            self._close()
            return
        log.info("%s: closed while still sending its request, to make room (--max-http-connections %d): 503",
                 self._peer, self.guard.max_connections)
        self._close(_raw_response(503, "too many connections were open; this one waited longest for its "
                                       "request, retry", "too_many_connections"))

    def _has_partial_request(self) -> bool:
        return self._phase == "body" or bool(self.conn.trailing_data[0]) or bool(self._backlog)

    def _close(self, response: bytes | None = None) -> None:
        """Answer (if nothing has been answered yet) and close; the app, if running, reads a disconnect."""
        self._done = True
        self._set_deadline(None)
        cycle = self.cycle if self._phase == "body" else None  # a head phase's cycle is the previous request's
        if response is not None and (cycle is None or not cycle.response_started):
            self.transport.write(response)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # its writes go nowhere, and uvicorn reports nothing
            cycle.message_event.set()
        self.transport.close()
        self._watch_send()


class _DebugInfo(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Logs INFO at DEBUG; warnings and errors pass unchanged."""

    def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args, **kwargs)


class SluiceWebSocketProtocol(_ChargedReads, WebSocketsSansIOProtocol):
    """websockets-sansio, but an upgrade refused with a denial response counts as a finished handshake.

    uvicorn forgets to mark it so and logs "ASGI callable returned without completing handshake" at ERROR
    for every refused upgrade (Kludex/uvicorn#3138; its wsproto protocol gets it right). It also logs a
    traceback at ERROR for each text frame that is not UTF-8; here that is one line at INFO, and the same
    close 1007. websockets' own INFO lines ("connection open", "connection rejected", "connection closed")
    repeat uvicorn's line for the same upgrade, so they go to DEBUG.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn.logger = _DebugInfo(self.conn.logger, {})
        # the socket's own for its upgrade's head, then its peer's (`GuardedH11Protocol.handle_websocket_upgrade`),
        # then its client's, once the app names it (`charge_to`)
        self.loop_budget = LoopBudget()
        self._init_reads()
        self.app = metered(self.app, self._charge)  # (until authenticated, charged as its reads are)

    def handle_connect(self, event: h11.Request) -> None:
        super().handle_connect(event)
        if getattr(self, "scope", None) is not None:  # (absent when the upgrade itself was refused)
            self.scope["extensions"][SEND_TEXT_NOW] = self.send_text_now
            self.scope["extensions"][CHARGE_TO] = self.charge_to

    def charge_to(self, budget: LoopBudget) -> None:
        """From now on this socket's reads, and its app's handling until authenticated, are charged to `budget`: its
        client's, shared by the client's every connection (service/budget.py)."""
        self.loop_budget = budget

    def send_text_now(self, data: bytes) -> bool:
        """Writes a text frame of UTF-8 `data` to the socket now, without the ASGI layers in between (the `send`
        of `{"type": "websocket.send", "text": ...}` does the same after them). False, and nothing written, where
        that `send` would wait or refuse: before the handshake, while the socket's write buffer is over its high
        water mark, or once the socket is closing."""
        if (not self.handshake_complete or self.initial_response is not None or self.close_sent or self.disconnected
                or not self.writable.is_set() or self.transport.is_closing()):
            return False
        try:
            self.conn.send_text(data)
        except InvalidState:  # the peer's close frame came in: `send` raises ClientDisconnected for this
            return False
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True

    def data_received(self, data: bytes) -> None:
        self._take(data)

    async def receive(self) -> Any:
        message = await super().receive()
        self._feed()  # uvicorn resumes reading once the app has taken every message: the backlog and budget first
        return message

    def resume_writing(self) -> None:
        super().resume_writing()
        self._feed()

    # ---- its reads, charged to the socket's budget (_ChargedReads) -------------------------------
    def _parse(self, data: bytes) -> None:
        super().data_received(data)

    def _charge(self, seconds: float) -> float:
        return self.loop_budget.charge(seconds)

    def _may_parse(self) -> bool:
        # uvicorn writes a pong for every ping at once, past the write buffer's high water mark: a client that sends
        # pings and reads nothing grew the server's memory without bound. While the buffer is over the mark nothing
        # more is parsed or read, so its frames wait in TCP.
        return self.writable.is_set()

    def _uvicorn_paused(self) -> bool:
        return self.read_paused

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        self._abort_unless_drained()

    def _abort_unless_drained(self) -> None:
        """`transport.close()` waits until the write buffer is sent; for a peer that reads nothing it never is, and the
        socket would stay open for ever, its chats running, its memory and its connection slot held. Past its
        deadline (a keepalive ping unanswered, or a close handshake not finished in `close_timeout`) a socket with
        bytes still unsent is dropped."""
        if not self.disconnected and self.transport.get_write_buffer_size():
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_reads()
        super().connection_lost(exc)

    def _close_or_abort(self) -> None:
        self.close_timer = None
        self.transport.close()
        self._abort_unless_drained()

    def handle_cont(self, event: Frame) -> None:
        # a fragmented message goes into one buffer: uvicorn kept each fragment as a bytes object of its own, and a
        # message of 2-byte fragments, its bytes within --max-message-bytes, held ~30 times as much memory
        buffer = self.frames[0] if self.frames and isinstance(self.frames[0], bytearray) else bytearray(
            b"".join(self.frames))
        buffer += event.data
        self.frames = [buffer]
        if event.fin:
            self.frames = [bytes(buffer)]
            self.send_receive_event_to_app()

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            try:
                b"".join(self.frames).decode()
            except UnicodeDecodeError:
                log.info("%s: a text frame that is not UTF-8: close 1007", get_client_addr(self.scope))
                self.frames = []
                self.conn.send_close(1007)
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.close" and self.close_timer is not None:  # (as keepalive_timeout's close)
            self.close_timer.cancel()
            self.close_timer = self.loop.call_later(self.close_timeout, self._close_or_abort)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True
