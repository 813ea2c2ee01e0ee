"""The engine process's child (service/engine_process.py is the server's side of it): how it is spawned, with its
two pipes and the progress it shares, and what it runs. Light on purpose (torch and the engine are imported in the
child only): `sluice serve` starts the child before its own imports, so the child's run beside them; the first
`EngineProcess` takes it and sends it what to build its engine from.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from service.config import LOG_FORMAT

if TYPE_CHECKING:
    from service.engine_thread import Command

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
        self.process = _SPAWN.Process(target=_main, name="sluice-engine", daemon=False,  # a daemon may not start
                                      args=(child_commands, child_results, self.progress, os.getpid()))  # TP ranks
        self._child_ends: tuple[Connection, ...] = (child_commands, child_results)

    @property
    def started(self) -> bool:
        return not self._child_ends

    def start(self) -> None:
        # NOTE: the child inherits this thread's signal mask through the spawn's exec: SIGINT and SIGTERM stay blocked
        # in it until it ignores them (a Ctrl-C while it imports torch would kill it). multiprocessing's resource
        # tracker is started first: starting it (on a process's first spawn) unblocks them, whatever the mask was
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for end in self._child_ends:  # the child's now: once it exits, this side reads EOF
            end.close()
        self._child_ends = ()


def _main(commands: Connection, results: Connection, progress: Any, server: int) -> None:
    """The child's main thread: its imports, then the engine its first command describes, until a `Stop` (or its
    server's end)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    from engine.parallel import watch_parent  # torch and the engine: beside the server's own imports, if early
    from service.engine_thread import EngineWorker, Stop

    threading.Thread(target=watch_parent, args=(server,), name="sluice-server-watch", daemon=True).start()
    try:
        factory, pinned, log_level, counters = pickle.loads(commands.recv_bytes())
    except (EOFError, OSError):  # its server is gone before it had an engine
        os._exit(0)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def take_commands() -> None:
        """The pipe into the worker's inbox. Its end without a `Stop` means the server is gone: the worker stops."""
        while True:
            try:
                command = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):
                command = Stop()
            inbox.put(command)
            if isinstance(command, Stop):
                return

    def post(name: str, *args: Any) -> None:
        try:
            results.send_bytes(pickle.dumps((name, args), pickle.HIGHEST_PROTOCOL))
        except OSError:  # the server is gone
            raise SystemExit from None

    threading.Thread(target=take_commands, name="sluice-engine-commands", daemon=True).start()
    # NOTE: its build is not timed by the watchdog, a replacement's neither: it loads the model (from disk), which may
    # take longer than a step may; the pinning and every step are
    EngineWorker(factory, pinned, inbox, post, progress, counters=counters).run()
    # NOTE: what it sent is in the pipe already, and its engine is closed: the interpreter's teardown (torch's
    # included; over a second on a small CPU) would only delay the server's own stop
    logging.shutdown()
    os._exit(0)


_early: EngineChild | None = None


def start_early() -> None:
    """`sluice serve --engine-process`, before it imports the server: the child starts now and the first
    `EngineProcess` takes it. If none does (the server failed to start), it is killed at exit; it held nothing yet."""
    global _early
    _early = EngineChild()
    atexit.register(_kill_unused)  # first: a Ctrl-C during the start must not leave it behind
    _early.start()


def take() -> EngineChild:
    """The child started early, once; else a new one, not started."""
    global _early
    child, _early = _early or EngineChild(), None
    return child


def _kill_unused() -> None:
    if _early is not None and _early.process.pid is not None:
        _early.process.kill()
