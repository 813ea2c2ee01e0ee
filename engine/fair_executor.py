"""`FairExecutor`: one worker thread that runs jobs taking their clients in turn (docs/architecture.md §1).

The server's prompts are templated and tokenized on one thread, and the engine's grammars compile on another
(engine/structured.py). In arrival order, a client with many costly jobs queued (16 prompts in flight of ~260,000
characters each: ~0.25 s apiece; or a dozen distinct JSON schemas, each up to `COMPILE_TIMEOUT_S`) would hold every
other client's next job behind all of its own. Here each client's jobs run in its own order, and the clients with
jobs queued take turns: another client's job waits for at most one job of each client ahead of it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("sluice.executor")

_Job = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class FairExecutor:
    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self.name, self.initializer = name, initializer
        self._cv = threading.Condition()
        self._queues: OrderedDict[Hashable, deque[_Job]] = OrderedDict()  # clients with jobs, whose turn is next first
        self._thread: threading.Thread | None = None  # started with the first job
        self._closed = False

    def submit(self, client: Hashable, fn: Callable[..., Any], *args: Any) -> Future:
        """`fn(*args)` on the worker thread, after `client`'s earlier jobs; a `concurrent.futures.Future` of it, whose
        `started` is the `time.monotonic()` its job began at once it has (a time limit may count from there, not from
        its time queued)."""
        future: Future = Future()
        job = (future, fn, args)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            self._queues.setdefault(client, deque()).append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify()
        # cancelled while queued: out of the queue at once (its arguments, a whole prompt, with it), costing no turn
        future.add_done_callback(lambda f: f.cancelled() and self._forget(client, job))
        return future

    def _forget(self, client: Hashable, job: _Job) -> None:
        with self._cv:
            jobs = self._queues.get(client)
            if jobs is not None and any(j is job for j in jobs):
                jobs.remove(job)
                if not jobs:
                    del self._queues[client]

    def shutdown(self) -> None:
        """Cancels every job not started; the worker ends after the one it runs."""
        with self._cv:
            self._closed = True
            queued = [future for jobs in self._queues.values() for future, _, _ in jobs]
            self._queues.clear()
            self._cv.notify_all()
        for future in queued:
            future.cancel()

    def _next(self) -> _Job | None:
        with self._cv:
            while not self._queues and not self._closed:
                self._cv.wait()
            if not self._queues:
                return None
            client, jobs = self._queues.popitem(last=False)
            job = jobs.popleft()
            if jobs:
                self._queues[client] = jobs  # its next job after every other client's
            return job

    def _run(self) -> None:
        if self.initializer is not None:
            try:
                self.initializer()
            except Exception:  # (it only tunes the thread: the jobs still run)
                log.exception("%s: its initializer failed", self.name)
        while (job := self._next()) is not None:
            future, fn, args = job
            future.started = time.monotonic()  # type: ignore[attr-defined]
            if future.set_running_or_notify_cancel():  # (else cancelled while queued)
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller's to see
                    future.set_exception(e)
            del job, future, fn, args  # (waiting, it holds nothing of the last job: a whole prompt, a grammar)
