"""`LoopBudget`: one client's share of the event loop, as a token bucket of loop seconds.

Every frame a connection sends costs the loop some time to parse (an empty ping: microseconds, and a client
can send a million a second), and each message to decode and check (a 1 MB frame of 28,000 tiny messages:
~7 ms). A client that sends such frames as fast as it is answered would keep the loop busy, and, through the
GIL, stall the engine thread and every other stream. A client (an address, as service/handle.py `client_key`
groups them) has one budget (`PeerBudgets`), whatever it sends and on however many connections: a WebSocket's
reads (service/transport.py) and its reader's decoding (service/ws.py), an HTTP connection's reads and each HTTP
request's handling until the engine has it (`Metered`: routing, the key check, the body's decoding, a quick answer
such as `/metrics`). A client that has spent its burst is read no more, nor its next pipelined request begun, for a
while; TCP then holds it back. Ordinary chat frames cost microseconds and never wait.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Generator
from typing import Any

SHARE = 0.1  # of the loop's time, per client, sustained
BURST_S = 0.01  # loop seconds a client may spend at once before it is slowed
METER = "sluice.meter"  # the ASGI scope key of an HTTP request's or a WebSocket's `Metered` (service/transport.py)


class LoopBudget:
    def __init__(self, share: float = SHARE, burst_s: float = BURST_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.share, self.burst_s, self.clock = share, burst_s, clock
        self.tokens = burst_s
        self.at = clock()

    def charge(self, seconds: float) -> float:
        """Spend `seconds` of loop time; returns how long to wait before the connection's next frame."""
        now = self.clock()
        self.tokens = min(self.burst_s, self.tokens + (now - self.at) * self.share) - seconds
        self.at = now
        return max(0.0, -self.tokens / self.share)


class PeerBudgets:
    """A `LoopBudget` per client: the budgets of the `size` most recently charged clients, and of every client with
    a WebSocket open (`hold`), are remembered (a forgotten one starts afresh, with a full burst). Keys are
    `client_key`s: HTTP charges its socket's peer; a WebSocket, `client_of` its upgrade (a trusted proxy's
    X-Forwarded-For), as the scheduler shares the engine."""

    def __init__(self, size: int = 4096, **budget: float) -> None:
        self.size, self.params = size, budget
        self._by_peer: OrderedDict[str, LoopBudget] = OrderedDict()
        self._held: dict[str, tuple[LoopBudget, int]] = {}  # a budget and the sockets holding it

    def charge(self, peer: str, seconds: float) -> float:
        """As `LoopBudget.charge`, for this peer's budget."""
        return self.budget(peer).charge(seconds)

    def budget(self, peer: str) -> LoopBudget:
        """This peer's budget, remembered as a charge would (a socket may charge it directly for a while: a WebSocket,
        from its upgrade until its app names its client's)."""
        if (held := self._held.get(peer)) is not None:
            return held[0]
        budget = self._by_peer.pop(peer, None) or self._new()
        self._remember(peer, budget)
        return budget

    def hold(self, peer: str) -> LoopBudget:
        """This peer's budget, remembered until as many `release`s: a WebSocket's, which charges it directly."""
        budget, holders = self._held.get(peer) or (self._by_peer.pop(peer, None) or self._new(), 0)
        self._held[peer] = budget, holders + 1
        return budget

    def release(self, peer: str) -> None:
        budget, holders = self._held.pop(peer)
        if holders > 1:
            self._held[peer] = budget, holders - 1
        else:
            self._remember(peer, budget)

    def _new(self) -> LoopBudget:
        return LoopBudget(**self.params)  # type: ignore[arg-type]

    def _remember(self, peer: str, budget: LoopBudget) -> None:
        self._by_peer[peer] = budget
        if len(self._by_peer) > self.size:
            self._by_peer.popitem(last=False)


class Metered:
    """An HTTP request's app call, or a WebSocket's, awaited step by step: the loop time of each step (from a
    resumption to the next suspension) is charged with `charge` until `stop()`. Without it, requests that make no work
    for the engine -- `GET /metrics`, `/health`, a 401 or a 404, pipelined on one connection or each on a new one, or
    WebSocket upgrades refused -- ran the server's loop flat out, uncounted. Once the engine has a request (`stop`, by
    the handler that submits it), what it costs the loop follows its tokens, which the scheduler shares between
    clients, and is not charged; a WebSocket's is stopped once it is authenticated (by its upgrade's header, or its
    `hello`), and its messages' decoding is charged as each one is read (service/ws.py)."""

    __slots__ = ("_coro", "_charge", "_step")

    def __init__(self, coro: Coroutine[Any, Any, Any], charge: Callable[[float], object]) -> None:
        self._coro, self._charge = coro, charge
        self._step = 0.0  # when the running step began

    @property
    def metering(self) -> bool:
        """Whether the running step is charged (not stopped, not ended)."""
        return self._charge is not None

    def stop(self) -> None:
        """Charges the running step so far (what led up to the engine's taking the request), and nothing after."""
        if self._charge is not None:
            self._charge(time.perf_counter() - self._step)
            self._charge = None

    def __await__(self) -> Generator[Any, Any, Any]:
        steps = self._coro.__await__()
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                self._step = time.perf_counter()
                try:
                    future = steps.send(value) if error is None else steps.throw(error)
                except StopIteration as done:
                    return done.value
                finally:
                    if self._charge is not None:
                        self._charge(time.perf_counter() - self._step)
                value, error = None, None
                try:
                    value = yield future
                except GeneratorExit:
                    steps.close()
                    raise
                except BaseException as e:  # (a cancellation, thrown in by the task: its to handle)
                    error = e
        finally:  # (the scope holds this, and `_charge` the protocol that holds the scope: no cycle left behind)
            self._coro = self._charge = None  # type: ignore[assignment]


def metered(app: Callable[..., Any], charge: Callable[[float], object]) -> Callable[..., Metered]:
    """`app` (an ASGI app), each of its calls awaited as a `Metered` charged with `charge`, which the call's scope
    holds under METER (`stop_metering`)."""

    def call(scope: dict[str, Any], receive: Any, send: Any) -> Metered:
        scope[METER] = meter = Metered(app(scope, receive, send), charge)
        return meter

    return call


def stop_metering(scope: dict[str, Any]) -> None:
    """The engine has the request of `scope`: its loop time is no longer charged to its peer (`Metered`)."""
    if (meter := scope.get(METER)) is not None:
        meter.stop()
