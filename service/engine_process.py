"""The engine in a process of its own (`--engine-process`; docs/architecture.md §1), as vLLM's engine core runs.

On a thread, the engine shares the interpreter lock with the event loop, and their host work takes turns: per
step, the engine's (schedule, prepare, sample, detokenize) and then the loop's (fan-out, framing, writes). In a
process of its own, the engine's runs beside the loop's.

The child runs the same `EngineWorker` as `EngineThread`, on its main thread (service/engine_child.py). Commands
cross one pipe and the listener's calls another, one pickle per message. The busy mark and step count the watchdog
reads sit in shared memory. On the loop's side a writer thread sends commands (the loop never waits on a pipe), and
a reader thread starts the child (unless `sluice serve` started it before its own imports), sends it what to build
its engine from, receives results and schedules each on the loop.

A child that dies without a word (a crash in native code, the OOM killer, `kill -9`) is reported as lost, like an
engine that raised, or as fatal before it was ready, like an engine that cannot be built; one that hangs is killed
by the watchdog. Its requests resume in a new process: the spare child started once the failed one was ready, its
imports done meanwhile (service/engine_child.py), which loads the model again (weights and the prefix cache do not
cross processes; its counters go on from the last stats the loop saw). That process gets its engine once the one
it replaces has ended, so the device memory it sizes its KV pool from is free. The child ignores SIGINT and SIGTERM
(a terminal's Ctrl-C, or a service manager's SIGTERM, reach the whole process group: the server decides when its
engine stops) and ends by itself within a second of its server's death.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine import LLMEngine
from engine.loader import auto_tokenizer
from service import engine_child
from service.engine_thread import Command, EngineHost, Listener, Stop

log = logging.getLogger("sluice.engine_process")

_LAST_WORDS = ("on_fatal", "on_lost")  # the calls after which a child posts nothing more
PREDECESSOR_WAIT_S = 30.0  # how long a replacement waits for the process it replaces to end before killing it


class EngineProcess(EngineHost):
    """`factory` and everything sent must pickle (`partial(LLMEngine, config)` does; a closure does not). `after`:
    the host this one replaces (its engine is sent once that one's process has ended); `counters`: the last stats of the
    engine it replaces (its counters go on from them); `spare`: once ready, start a spare child for its replacement
    (service/engine_child.py)."""

    def __init__(self, factory: Callable[[], LLMEngine], listener: Listener, loop: asyncio.AbstractEventLoop,
                 pinned_system_prompts: Sequence[str] = (), *, replacement: bool = False,
                 after: EngineProcess | None = None, counters: Mapping[str, Any] | None = None,
                 spare: bool = False) -> None:
        self._child = engine_child.take()  # started already where `sluice serve` started it early, or a spare
        self._spare = spare
        super().__init__(listener, loop, self._child.progress, replacement=replacement)
        self._process = self._child.process
        self._commands, self._results = self._child.commands, self._child.results
        self._build = (factory, list(pinned_system_prompts), logging.getLogger().level,
                       dict(counters) if counters else None)  # the child's first command: what it builds
        self._after = after
        self._outbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the child's start against a kill
        self._killed = False  # it will never run an engine: killed, or replaced before it started (under _lock)
        self._stopping = False  # told to Stop: its end is expected
        self._writer = threading.Thread(target=self._write, name="sluice-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="sluice-engine-reader", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        self._reader.start()  # once the one this replaces has ended, it starts the child (unless started) and
        # sends it its engine, then reads

    def send(self, command: Command) -> None:
        if isinstance(command, Stop):
            self._stopping = True
        self._outbox.put(command)

    def join(self, timeout: float) -> None:
        """Waits until the child has ended and everything it sent was taken; kills it after `timeout`."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            log.warning("the engine process did not stop within %.0f s: killing it", timeout)
            self.kill()
            self._reader.join(5.0)

    def abandon(self, stuck: bool = False) -> None:
        """On the loop: this process's engine is replaced. Nothing it sends reaches the listener from now on; it
        ends after its current step, or at once if `stuck` (killed: its memory, the device's too, is freed)."""
        self.abandoned = True
        self.send(Stop())
        if stuck:
            self.kill()

    def kill(self) -> None:
        with self._lock:
            if self._child.started:
                self._process.kill()
            self._killed = True

    def _start_child(self) -> bool:
        """On the reader thread: starts the child (unless `sluice serve` did) and sends it its engine. False if it was
        killed (replaced) before that."""
        if self._after is not None:
            self._after.join(PREDECESSOR_WAIT_S)
        with self._lock:
            if self._killed:
                return False
            if not self._child.started:
                self._child.start()
        build = pickle.dumps(self._build, pickle.HIGHEST_PROTOCOL)
        try:
            self._commands.send_bytes(build)
        except OSError:  # it is gone already (or killed just now): the reader reads its end, and says how it ended
            pass
        self._writer.start()
        auto_tokenizer()  # imported, as unpickling its `on_ready` needs: now, while the child loads its model
        return True

    def _write(self) -> None:
        try:
            while True:
                command = self._outbox.get()
                self._commands.send_bytes(pickle.dumps(command, pickle.HIGHEST_PROTOCOL))
                if isinstance(command, Stop):
                    return
        except OSError:  # the child is gone; the reader says so
            pass
        except Exception:
            log.exception("the engine process's commands failed: killing it")
            self.kill()
        finally:
            self._commands.close()

    def _read(self) -> None:
        ready = last_words = False
        failure = None
        try:
            if not self._start_child():
                if self._child.started:  # killed before it had its engine
                    self._process.join()
                return
            while True:
                try:
                    data = self._results.recv_bytes()
                except (EOFError, OSError):
                    break
                name, args = pickle.loads(data)
                last_words = name in _LAST_WORDS
                self._schedule(name, *args)
                if name == "on_ready":
                    ready = True
                    if self._spare:
                        engine_child.start_spare()
        except SystemExit:  # the loop is closed: the server is gone (and the child, watching it, goes too)
            return
        except Exception as e:  # e.g. a child that could not start, or a message that would not unpickle
            log.exception("the engine process failed")
            failure = f"{type(e).__name__}: {e}"
            self.kill()
        if self._child.started:
            self._process.join()
        if last_words or self._stopping:  # (abandoning one sends it a Stop)
            return
        if failure is None:
            code = self._process.exitcode or 0
            failure = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            log.error("the engine process %s ended without a word (%s)", self._process.pid, failure)
        try:
            if ready:
                self._schedule("on_lost", f"the engine process died ({failure})", False)
            else:  # as an engine that cannot be built: loading it again would fail the same way
                self._schedule("on_fatal", f"the engine process died while starting ({failure})")
        except SystemExit:
            pass
