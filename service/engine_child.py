"""The engine process's child (service/engine_process.py is the server's side of it): how it is spawned, with its
two pipes and the progress it shares, and what it runs. Light on purpose (torch and the engine are imported in the
child only): `sluice serve` starts the child before its own imports, so the child's run beside them; the first
`EngineProcess` takes it and sends it what to build its engine from.

Once an engine that would be replaced after a failure is ready, a spare child is started for the replacement: it
does its imports (torch, the engine, transformers' tokenizers and model configs: ~6 s of a 2-core CPU, most of a
small model's start) at the lowest priority while the engine serves, then waits. The replacement then only loads
the model.
"""
from __future__ import annotations

import atexit
import importlib
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
log = logging.getLogger("sluice.engine_child")
SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the child's server handles these, not the child
SPARE_NICENESS = 19  # a spare's imports run at this niceness: the engine serving meanwhile comes first


class EngineChild:
    """A spawned process and the server's ends of its pipes: commands in (the first message is its engine: factory
    and settings), results out. `progress` is shared: [0] the monotonic start of the step now running (-1 when
    none), [1] the steps done, [2] 1 once its imports are done (`imported`)."""

    def __init__(self, spare: bool = False) -> None:
        """`spare`: its imports run at the lowest priority (an engine is serving meanwhile)."""
        self.progress: Any = _SPAWN.RawArray("d", 3)
        self.progress[0] = -1.0
        child_commands, self.commands = _SPAWN.Pipe(duplex=False)
        self.results, child_results = _SPAWN.Pipe(duplex=False)
        self.process = _SPAWN.Process(target=_main, name="sluice-engine", daemon=False,  # a daemon may not start
                                      args=(child_commands, child_results, self.progress, os.getpid(), spare))  # TP
        self._child_ends: tuple[Connection, ...] = (child_commands, child_results)

    @property
    def started(self) -> bool:
        return not self._child_ends

    @property
    def imported(self) -> bool:
        """Its imports are done: an engine's build now waits for the model alone."""
        return self.progress[2] == 1.0

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


def _imports(idle: bool) -> None:
    """What every engine's build waits for but its model: torch, the engine, transformers' tokenizers. `idle`: on a
    thread at the lowest priority (Linux sets niceness per thread; the threads the engine starts later are the main
    thread's, at its priority)."""
    if idle:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SPARE_NICENESS)
        except (AttributeError, OSError):  # not Linux, or not permitted: the same priority
            pass
    importlib.import_module("service.engine_thread")  # torch and the engine
    from engine.loader import preload_tokenizers

    preload_tokenizers()


def _import_as_spare(commands: Connection, server: int) -> None:
    """A spare's imports, on a thread at `SPARE_NICENESS`, while its main thread watches: the spare ends with its
    server, and a build that arrives before they are done (its engine died within seconds of its start) lifts their
    priority back where the process may (root, or a `RLIMIT_NICE` that allows it; else they finish at theirs)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            _imports(True)
        except BaseException as e:
            failed.append(e)

    importer = threading.Thread(target=run, name="sluice-spare-imports")
    importer.start()
    taken = False
    while importer.is_alive():
        if os.getppid() != server:
            os._exit(0)
        if taken:
            importer.join(0.1)
        elif commands.poll(0.1):  # its build (or its server's end, which the check above sees next)
            taken = True
            try:
                os.setpriority(os.PRIO_PROCESS, importer.native_id or 0, 0)
            except OSError:
                pass
    if failed:  # not to be built on: it ends, and `take` passes over a dead spare
        log.error("a spare engine process failed to import: %s: %s", type(failed[0]).__name__, failed[0])
        os._exit(1)


def _main(commands: Connection, results: Connection, progress: Any, server: int, spare: bool) -> None:
    """The child's main thread: its imports, then the engine its first command describes, until a `Stop` (or its
    server's end)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    if spare:
        _import_as_spare(commands, server)
    else:  # beside the server's own imports, if early
        _imports(False)
    progress[2] = 1.0
    from engine.parallel import watch_parent
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


_early: EngineChild | None = None  # started by `sluice serve` before its imports, for its first engine
_spare: EngineChild | None = None  # started once an engine is ready, for its replacement
_lock = threading.Lock()  # `_spare`: started on a reader thread, taken on the loop


def start_early() -> None:
    """`sluice serve --engine-process`, before it imports the server: the child starts now and the first
    `EngineProcess` takes it. If none does (the server failed to start), it is killed at exit; it held nothing yet."""
    global _early
    _early = EngineChild()
    _kill_at_exit()  # first: a Ctrl-C during the start must not leave it behind
    _early.start()


def start_spare() -> None:
    """A spare child for the next `EngineProcess` (module docstring), unless one is waiting already; killed at exit if
    none takes it. Off the loop: a spawn takes milliseconds. One that cannot start (no file descriptors or processes
    left) is logged and left out: the replacement spawns its own, as without a spare."""
    global _spare
    with _lock:
        if _spare is not None and _spare.process.is_alive():
            return
        _kill_at_exit()
        try:
            child = EngineChild(spare=True)  # (its pipes need file descriptors too)
            child.start()
        except Exception as e:
            log.warning("a spare engine process could not start (a replacement will spawn its own): %s: %s",
                        type(e).__name__, e)
            return
        _spare = child


def take() -> EngineChild:
    """The child started early, once; else the spare, if it is still alive (one the OOM killer took while it waited
    must not fail a replacement); else a new one, not started."""
    global _early, _spare
    with _lock:
        child, _early = _early, None
        if child is None:
            child, _spare = _spare, None
            if child is not None and not child.process.is_alive():
                child.process.join()
                child = None
    return child or EngineChild()


_registered = False


def _kill_at_exit() -> None:
    """A child no `EngineProcess` took is killed at exit (multiprocessing would wait for it, and it for its engine)."""
    global _registered
    if not _registered:
        atexit.register(_kill_unused)
        _registered = True


def _kill_unused() -> None:
    with _lock:  # (a reader thread may be starting a spare)
        children = (_early, _spare)
    for child in children:
        if child is not None and child.process.pid is not None and child.process.is_alive():
            child.process.kill()
            child.process.join()
