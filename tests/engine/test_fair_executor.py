"""`FairExecutor` (the tokenizer thread's queue): clients with jobs queued take turns, each client's jobs in order;
a job cancelled while queued never runs; a failing job's exception reaches its caller. Gated on events, not time."""
from __future__ import annotations

import threading

import pytest

from engine.fair_executor import FairExecutor


def test_clients_take_turns_and_each_keeps_its_order() -> None:
    ex = FairExecutor("test-fair")
    gate, running, ran = threading.Event(), threading.Event(), []

    def job(name: str) -> str:
        if name == "a0":
            running.set()
            gate.wait(10)  # the worker holds a0 while the rest queue up
        ran.append(name)
        return name

    futures = [ex.submit("a", job, "a0")]
    assert running.wait(10)
    futures += [ex.submit("a", job, f"a{i}") for i in range(1, 16)]  # a flood of one client's prompts
    futures += [ex.submit("b", job, "b0"), ex.submit("c", job, "c0"), ex.submit("b", job, "b1")]
    gate.set()
    assert [f.result(10) for f in futures] == [*(f"a{i}" for i in range(16)), "b0", "c0", "b1"]
    # b0 waited for one of a's jobs after the running one, not fifteen; c0 for one of a's and b's
    assert ran[:6] == ["a0", "a1", "b0", "c0", "a2", "b1"] and ran[6:] == [f"a{i}" for i in range(3, 16)]
    ex.shutdown()


def test_cancelled_jobs_do_not_run_failures_reach_the_caller_and_shutdown_cancels() -> None:
    ex = FairExecutor("test-fair")
    gate, running, ran = threading.Event(), threading.Event(), []
    first = ex.submit("a", lambda: running.set() or gate.wait(10))
    assert running.wait(10)
    skipped = ex.submit("a", ran.append, "skipped")
    assert skipped.cancel()
    assert list(ex._queues) == []  # a cancelled job leaves the queue at once: it holds its arguments no longer
    failing = ex.submit("b", lambda: 1 / 0)
    queued = ex.submit("c", ran.append, "queued")
    gate.set()
    assert first.result(10) is True
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    queued.result(10)
    assert ran == ["queued"]
    gate.clear()
    ex.submit("a", gate.wait, 10)
    left = ex.submit("a", ran.append, "left")
    ex.shutdown()
    gate.set()
    assert left.cancelled() and ran == ["queued"]
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit("a", ran.append, "late")
