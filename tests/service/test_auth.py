"""`PendingAuth` (service/auth.py): sockets waiting to authenticate push out only each other, oldest first."""
from __future__ import annotations

from service.auth import PendingAuth


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
