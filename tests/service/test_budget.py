"""LoopBudget (service/budget.py): ordinary frames never wait; a client that keeps spending the loop's time
waits so that, sustained, it gets `share` of it, however many connections it spends it on."""
from __future__ import annotations

import pytest

from service.budget import LoopBudget, PeerBudgets


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_cheap_frames_never_wait() -> None:
    clock = Clock()
    budget = LoopBudget(share=0.1, burst_s=0.01, clock=clock)
    for _ in range(10_000):  # 10,000 frames of 50 us, one every 1 ms: 5% of the loop
        clock.t += 0.001
        assert budget.charge(50e-6) == 0.0


def test_expensive_frames_get_their_share() -> None:
    clock = Clock()
    budget = LoopBudget(share=0.1, burst_s=0.01, clock=clock)
    spent = 0.0
    for _ in range(1000):  # 7 ms frames, sent as soon as the reader is willing
        clock.t += 0.007  # handling the frame
        wait = budget.charge(0.007)
        spent += 0.007
        clock.t += wait
    assert abs(spent / clock.t - 0.1) < 0.01, spent / clock.t


def test_peers_are_charged_apart_and_the_table_is_bounded() -> None:
    clock = Clock()
    peers = PeerBudgets(size=2, share=0.1, burst_s=0.01, clock=clock)
    assert peers.charge("flood", 0.05) > 0  # past its burst: its next reads and requests wait
    assert peers.charge("other", 0.001) == 0.0  # another peer is not slowed by it
    peers.charge("third", 0.001)  # the table keeps two: "flood", least recently charged, is forgotten
    assert peers.charge("flood", 0.001) == 0.0 and len(peers._by_peer) == 2


def test_a_held_budget_is_shared_and_never_forgotten_until_released() -> None:
    """A client's WebSockets hold its budget (`hold`) and charge it directly: every socket of it, and its HTTP
    requests, spend one budget; while a socket holds it, it is not forgotten however many peers are charged since
    (a new budget would be a full burst, and a second share); released by the last, it is remembered as any."""
    clock = Clock()
    peers = PeerBudgets(size=2, share=0.1, burst_s=0.01, clock=clock)
    one, two = peers.hold("client"), peers.hold("client")
    assert one is two
    assert one.charge(0.05) > 0
    assert two.charge(0.0) > 0 and peers.charge("client", 0.0) > 0  # (its other socket, its HTTP: spent too)
    for i in range(5):  # more peers than the table keeps
        peers.charge(f"p{i}", 0.001)
    assert peers.charge("client", 0.0) > 0 and peers.hold("client") is one
    for _ in range(3):
        peers.release("client")
    assert peers.charge("client", 0.0) > 0 and "client" in peers._by_peer and not peers._held  # (remembered)
    peers.charge("p8", 0.001)
    peers.charge("p9", 0.001)
    assert peers.hold("client") is not one  # (forgotten at last: a fresh budget)


async def test_metered_charges_each_step_until_stopped_and_passes_everything_through() -> None:
    """`Metered` charges each step of the call (not the time it is suspended) until `stop()`; the call's value, its
    exceptions and a cancellation pass through as if it were awaited directly."""
    import asyncio
    import time

    from service.budget import Metered

    charged: list[float] = []
    meter: Metered

    async def call() -> str:
        time.sleep(0.02)  # (a step: the loop is busy)
        await asyncio.sleep(0.2)  # (suspended: not charged)
        time.sleep(0.02)
        meter.stop()  # (the engine has it: this step is charged up to here, the next not)
        await asyncio.sleep(0)
        time.sleep(0.02)
        return "done"

    meter = Metered(call(), charged.append)
    assert await meter == "done"
    assert len(charged) == 2 and all(0.02 <= s < 0.2 for s in charged), charged

    async def fails() -> None:
        await asyncio.sleep(0)
        raise KeyError("x")

    with pytest.raises(KeyError):
        await Metered(fails(), charged.append)

    cleaned = asyncio.Event()

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()

    task = asyncio.ensure_future(Metered(waits(), charged.append))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()


async def test_a_finished_meter_holds_neither_its_call_nor_its_charge() -> None:
    """The scope holds its meter and the meter the protocol's `_charge`, and the protocol the scope: once the call
    has ended the meter lets go of both, so a closed connection is freed at once, not by a full collection."""
    import weakref

    from service.budget import Metered

    class Protocol:
        def charge(self, seconds: float) -> float:
            return 0.0

    async def call() -> str:
        return "done"

    protocol = Protocol()
    gone = weakref.ref(protocol)
    meter = Metered(call(), protocol.charge)
    assert meter.metering and await meter == "done" and not meter.metering
    del protocol
    assert gone() is None
