"""`PendingAuth` (service/auth.py): sockets waiting to authenticate push out only each other, oldest first.
`Connections` (service/state.py): the authenticated ones, and each client's share of them."""
from __future__ import annotations

from service.auth import PendingAuth
from service.state import Connections


def test_admitting_past_the_limit_evicts_the_oldest() -> None:
    pool = PendingAuth(limit=2)
    a, b = pool.admit("a"), pool.admit("b")
    c = pool.admit("c")
    assert a.is_set() and not b.is_set() and not c.is_set() and len(pool) == 2
    pool.leave("b")  # authenticated (or gone): no longer waiting, never evicted
    d = pool.admit("d")
    assert not b.is_set() and not c.is_set() and not d.is_set()
    pool.admit("e")
    assert c.is_set() and not d.is_set()


def test_leave_is_idempotent_and_evict_all_empties() -> None:
    pool = PendingAuth(limit=3)
    events = [pool.admit(k) for k in "xyz"]
    pool.leave("x")
    pool.leave("x")
    pool.evict_all()
    assert len(pool) == 0 and not events[0].is_set() and events[1].is_set() and events[2].is_set()


def test_a_client_holds_at_most_its_share_of_the_connections() -> None:
    conns = Connections(limit=4)  # (a client's share: half, 2)
    conns.add("a1", "a")
    conns.add("a1", "a")  # (counted once)
    conns.add("a2", "a")
    assert conns.refusal("a")[0] == 429 and conns.refusal("b") is None
    conns.add("b1", "b")
    conns.add("b2", "b")
    assert conns.refusal("c")[0] == 503 and len(conns) == 4 and sorted(conns) == ["a1", "a2", "b1", "b2"]
    conns.discard("a1")
    conns.discard("a1")  # (once)
    assert conns.refusal("a") is None and conns.refusal("b")[0] == 429 and len(conns) == 3


def test_a_share_without_a_limit_and_the_smallest_limit() -> None:
    conns = Connections(limit=None, per_client=1)
    conns.add("a1", "a")
    assert conns.refusal("a")[0] == 429 and conns.refusal("b") is None
    assert Connections(limit=None).refusal("a") is None and Connections(limit=None).per_client is None
    one = Connections(limit=1)  # (half of one: one)
    assert one.per_client == 1 and one.refusal("a") is None
    one.add("a1", "a")
    assert one.refusal("a")[0] == 503 and one.refusal("b")[0] == 503
