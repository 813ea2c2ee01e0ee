"""`LoopBudget`: one connection's share of the event loop, as a token bucket of loop seconds.

Every frame a connection sends costs the loop some time to parse (an empty ping: microseconds, and a client
can send a million a second), and each message to decode and check (a 1 MB frame of 28,000 tiny messages:
~7 ms). A client that sends such frames as fast as it is answered would keep the loop busy, and, through the
GIL, stall the engine thread and every other stream. A WebSocket's reads (service/transport.py) and its
reader's decoding (service/ws.py) charge their time to one budget and, once the connection has spent its
burst, read no more for a while; TCP then holds the client back.
Ordinary chat frames cost microseconds and never wait. HTTP request bodies are charged per peer address
(`PeerBudgets`): the response to a costly one waits instead.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

SHARE = 0.1  # of the loop's time, per connection, sustained
BURST_S = 0.01  # loop seconds a connection may spend at once before it is slowed


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
    """A `LoopBudget` per peer address, for HTTP, whose requests arrive on many short connections; the
    `size` most recently charged peers are remembered (a forgotten one starts afresh, with a full burst)."""

    def __init__(self, size: int = 4096, **budget: float) -> None:
        self.size, self.budget = size, budget
        self._by_peer: OrderedDict[str, LoopBudget] = OrderedDict()

    def charge(self, peer: str, seconds: float) -> float:
        """As `LoopBudget.charge`, for this peer's budget."""
        budget = self._by_peer.pop(peer, None) or LoopBudget(**self.budget)  # type: ignore[arg-type]
        self._by_peer[peer] = budget
        if len(self._by_peer) > self.size:
            self._by_peer.popitem(last=False)
        return budget.charge(seconds)
