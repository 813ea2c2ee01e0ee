"""The engine in a process of its own (`--engine-process`; docs/architecture.md §1), as vLLM's engine core runs.

On a thread, the engine shares the interpreter lock with the event loop, and their host work takes turns: per
step, the engine's (schedule, prepare, sample, detokenize) and then the loop's (fan-out, framing, writes). In a
process of its own, the engine's runs beside the loop's.

The child runs the same `EngineWorker` as `EngineThread`, on its main thread. Commands cross one pipe and the
listener's calls another, one pickle per message. The busy mark and step count the watchdog reads sit in shared
memory. On the loop's side a writer thread sends commands (the loop never waits on a pipe), and a reader thread
receives results and schedules each on the loop.

A child that dies without a word (a crash in native code, the OOM killer, `kill -9`) is reported as lost, like an
engine that raised, and so is one that hangs (the watchdog kills it). Its requests resume in a new process, which
loads the model again: weights and the prefix cache do not cross processes. A child whose server is gone stops.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable, MutableSequence, Sequence
from multiprocessing.connection import Connection
from typing import Any

from engine import LLMEngine
from service.config import LOG_FORMAT
from service.engine_thread import Command, EngineHost, EngineWorker, Listener, Stop

log = logging.getLogger("sluice.engine_process")

_SPAWN = multiprocessing.get_context("spawn")  # not fork: CUDA, and the threads the loop's process already runs
_LAST_WORDS = ("on_fatal", "on_lost")  # the calls after which a child posts nothing more


class EngineProcess(EngineHost):
    """`factory` and everything sent must pickle (`partial(LLMEngine, config)` does; a closure does not)."""

    def __init__(self, factory: Callable[[], LLMEngine], listener: Listener, loop: asyncio.AbstractEventLoop,
                 pinned_system_prompts: Sequence[str] = (), *, replacement: bool = False) -> None:
        progress = _SPAWN.RawArray("d", 2)
        progress[0] = -1.0
        super().__init__(listener, loop, progress, replacement=replacement)
        child_commands, self._commands = _SPAWN.Pipe(duplex=False)
        self._results, child_results = _SPAWN.Pipe(duplex=False)
        root = logging.getLogger()
        self._process = _SPAWN.Process(
            target=_main, name="sluice-engine", daemon=False,  # a daemon may not start children (tensor parallel's ranks)
            args=(factory, list(pinned_system_prompts), replacement, child_commands, child_results, progress,
                  root.level))
        self._child_ends = (child_commands, child_results)
        self._outbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stopping = False  # told to Stop: its end is expected
        self._writer = threading.Thread(target=self._write, name="sluice-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="sluice-engine-reader", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        self._process.start()
        for end in self._child_ends:  # the child's now: once it exits, this side reads EOF
            end.close()
        self._writer.start()
        self._reader.start()

    def send(self, command: Command) -> None:
        if isinstance(command, Stop):
            self._stopping = True
        self._outbox.put(command)

    def join(self, timeout: float) -> None:
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s: killing it", timeout)
            self._process.kill()
            self._process.join(5.0)

    def abandon(self, stuck: bool = False) -> None:
        """On the loop: this process's engine is replaced. Nothing it sends reaches the listener from now on; it
        ends after its current step, or at once if `stuck` (killed: its memory, the device's too, is freed)."""
        self.abandoned = True
        self.send(Stop())
        if stuck:
            self._process.kill()

    def _write(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                self._commands.send_bytes(pickle.dumps(command, pickle.HIGHEST_PROTOCOL))
            except OSError:  # the child is gone; the reader says so
                return
            if isinstance(command, Stop):
                self._commands.close()
                return

    def _read(self) -> None:
        last_words = False
        try:
            while True:
                try:
                    data = self._results.recv_bytes()
                except (EOFError, OSError):
                    break
                name, args = pickle.loads(data)
                last_words = name in _LAST_WORDS
                self._schedule(name, *args)
            self._process.join()
            if not (last_words or self._stopping or self.abandoned):
                code = self._process.exitcode or 0
                how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                log.error("the engine process %s ended without a word (%s)", self._process.pid, how)
                self._schedule("on_lost", f"the engine process died ({how})", False)
        except SystemExit:  # the loop is closed: the server is gone
            pass


def _main(factory: Callable[[], LLMEngine], pinned: list[str], replacement: bool, commands: Connection,
          results: Connection, progress: MutableSequence[float], log_level: int) -> None:
    """The child's main thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the process group: the server decides
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
    threading.Thread(target=_take_commands, args=(commands, inbox), name="sluice-engine-commands", daemon=True).start()

    def post(name: str, *args: Any) -> None:
        try:
            results.send_bytes(pickle.dumps((name, args), pickle.HIGHEST_PROTOCOL))
        except OSError:  # the server is gone
            raise SystemExit from None

    EngineWorker(factory, pinned, inbox, post, progress, replacement=replacement).run()


def _take_commands(commands: Connection, inbox: queue.SimpleQueue[Command]) -> None:
    """The pipe into the worker's inbox. Its end without a `Stop` means the server is gone: the worker stops."""
    while True:
        try:
            command = pickle.loads(commands.recv_bytes())
        except (EOFError, OSError):
            command = Stop()
        inbox.put(command)
        if isinstance(command, Stop):
            return
