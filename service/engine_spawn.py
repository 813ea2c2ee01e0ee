"""The engine process's child: spawned, with its two pipes and the progress it shares (service/engine_process.py
runs it). Light on purpose (no torch, no engine): `sluice serve` starts the child before its own imports, so the
child's (torch's, the engine's) run beside them; the first `EngineProcess` takes it and sends it its engine.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

_SPAWN = multiprocessing.get_context("spawn")  # not fork: CUDA, and the threads the server's process runs
SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the child's server handles these, not the child


class EngineChild:
    """A spawned process and the server's ends of its pipes: commands in (the first message is its engine: factory
    and settings), results out. `progress` is shared: [0] the monotonic start of the step now running (-1 when
    none), [1] the steps done."""

    def __init__(self) -> None:
        self.progress: Any = _SPAWN.RawArray("d", 2)
        self.progress[0] = -1.0
        child_commands, self.commands = _SPAWN.Pipe(duplex=False)
        self.results, child_results = _SPAWN.Pipe(duplex=False)
        self.process = _SPAWN.Process(target=_child, name="sluice-engine", daemon=False,  # a daemon may not start
                                      args=(child_commands, child_results, self.progress, os.getpid()))  # TP ranks
        self._child_ends: tuple[Connection, ...] = (child_commands, child_results)

    @property
    def started(self) -> bool:
        return not self._child_ends

    def start(self) -> None:
        # NOTE: the child inherits this thread's signal mask through the spawn's exec: SIGINT and SIGTERM stay blocked
        # in it until it ignores them (a Ctrl-C while it imports torch would kill it)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for end in self._child_ends:  # the child's now: once it exits, this side reads EOF
            end.close()
        self._child_ends = ()


def _child(commands: Connection, results: Connection, progress: Any, server: int) -> None:
    """The child's entry: its imports, then the engine its first command brings."""
    from service.engine_process import serve_engine  # torch and the engine: beside the server's own imports

    serve_engine(commands, results, progress, server)


_early: EngineChild | None = None


def start_early() -> None:
    """`sluice serve --engine-process`, before it imports the server: the child starts now and the first
    `EngineProcess` takes it. If none does (the server failed to start), it is killed at exit; it held nothing yet."""
    global _early
    _early = EngineChild()
    _early.start()
    atexit.register(_kill_unused)


def take() -> EngineChild:
    """The child started early, once; else a new one, not started."""
    global _early
    child, _early = _early or EngineChild(), None
    return child


def _kill_unused() -> None:
    if _early is not None:
        _early.process.kill()
