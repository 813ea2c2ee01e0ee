"""The engine in a process of its own (service/engine_process.py, `--engine-process`): the same commands and listener
calls as the engine thread, over pipes, and the ways a child can end: told to stop, a model that cannot load, killed,
or its server gone; signals its process group gets are not among them."""
from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from service import engine_child
from service.engine_process import EngineProcess
from service.engine_thread import Abort, Add, Stop
from tests.server import start_server
from tests.service.test_engine_thread import Recorder, _ids


def dies_while_loading() -> LLMEngine:
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    raise AssertionError("unreachable")


def no_spare() -> None:
    """Kills a spare an earlier test left in this process (any host would take it)."""
    spare, engine_child._spare = engine_child._spare, None
    if spare is not None:
        spare.process.kill()
        spare.process.join()


# the child steps without ever waiting for this process: a "long" request runs thousands of steps, so it is still
# running when a message sent after a few of them arrives, however fast the CPU and however busy this process
MAX_LEN = 4096
LONG = SamplingParams(max_tokens=MAX_LEN - 16, temperature=0.0, ignore_eos=True)


def tiny_factory(model_dir) -> partial:
    return partial(LLMEngine, EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=300,
                                           max_model_len=MAX_LEN))


@pytest.fixture
async def started(tiny_model_dir):
    recorder = Recorder()
    host = EngineProcess(tiny_factory(tiny_model_dir), recorder, asyncio.get_running_loop())
    host.start()
    await recorder.until(lambda: recorder.ready is not None or recorder.fatal is not None, timeout=120)
    assert recorder.ready is not None and recorder.ready.max_model_len == MAX_LEN
    yield host, recorder
    host.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, host.join, 10)


async def test_commands_in_results_out_signals_ignored_and_a_stop_ends_it_quietly(started) -> None:
    host, rec = started
    assert host.pid != os.getpid()
    assert rec.ready.processor.tokenize("hello there", False)  # the tokenizer crossed with it
    host.send(Add("short", _ids(8), SamplingParams(max_tokens=4, ignore_eos=True), fit_max_tokens=True))
    host.send(Add("long", _ids(8, 100), LONG, fit_max_tokens=True))
    host.send(Add("bad-id", [10**6], SamplingParams(), fit_max_tokens=True))
    await rec.until(lambda: "short" in rec.finished() and "bad-id" in rec.failures())
    assert rec.finished()["short"] == "length" and "long" not in rec.finished()
    assert rec.failures()["bad-id"].code == "invalid_message"
    assert host.steps_done > 0
    # a terminal's Ctrl-C, or a service manager's SIGTERM, reach every process of the group: the server decides
    os.kill(host.pid, signal.SIGINT)
    os.kill(host.pid, signal.SIGTERM)
    n = len(rec.steps)
    await rec.until(lambda: len(rec.steps) >= n + 5)  # it steps on
    host.send(Abort("long"))
    await rec.until(lambda: "long" in rec.finished())
    assert rec.finished()["long"] == "abort"
    await rec.until(lambda: rec.steps[-1].stats["num_running"] == 0)
    host.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, host.join, 30)
    await asyncio.sleep(0.2)  # whatever the reader would schedule has run
    assert host._process.exitcode == 0 and rec.lost is None and rec.fatal is None


async def test_a_killed_process_is_reported_lost(started) -> None:
    host, rec = started
    host.send(Add("long", _ids(8), LONG, fit_max_tokens=True))
    await rec.until(lambda: any(d.request_id == "long" and d.num_new_tokens for s in rec.steps for d in s.deliveries))
    os.kill(host.pid, signal.SIGKILL)
    await rec.until(lambda: rec.lost is not None)
    assert "killed by signal 9" in rec.lost and rec.kv_intact is False


async def test_an_abandoned_process_reaches_the_listener_no_more(started) -> None:
    host, rec = started
    host.send(Add("long", _ids(8), LONG, fit_max_tokens=True))
    await rec.until(lambda: len(rec.steps) >= 2)
    host.abandon(stuck=True)  # killed: the replacement the loop starts needs its memory
    n = len(rec.steps)
    await asyncio.get_running_loop().run_in_executor(None, host._process.join, 10)
    await asyncio.sleep(0.2)
    assert host._process.exitcode == -signal.SIGKILL
    assert len(rec.steps) == n and rec.lost is None  # not even its death is reported


async def test_a_model_that_cannot_load_is_fatal(tmp_path) -> None:
    rec = Recorder()
    host = EngineProcess(tiny_factory(tmp_path / "missing"), rec, asyncio.get_running_loop())
    host.start()
    await rec.until(lambda: rec.fatal is not None, timeout=120)
    assert "cannot load the model" in rec.fatal
    await asyncio.get_running_loop().run_in_executor(None, host._process.join, 30)
    await asyncio.sleep(0.2)
    assert host._process.exitcode == 0 and rec.lost is None  # its last word was the reason


async def test_a_process_that_dies_before_it_is_ready_is_fatal() -> None:
    rec = Recorder()
    host = EngineProcess(dies_while_loading, rec, asyncio.get_running_loop())
    host.start()
    await rec.until(lambda: rec.fatal is not None, timeout=120)
    assert "died while starting (killed by signal 9)" in rec.fatal and rec.lost is None


async def test_a_replacement_starts_once_the_process_it_replaces_has_ended(started, tiny_model_dir) -> None:
    """Its KV pool is sized from the device's free memory: the old process's must be free first."""
    old, old_rec = started
    rec = Recorder()
    stats = {**old_rec.ready.stats, "num_steps": 1000, "generation_tokens": 5000}
    new = EngineProcess(tiny_factory(tiny_model_dir), rec, asyncio.get_running_loop(), replacement=True, after=old,
                        counters=stats)
    new.start()
    await asyncio.sleep(1.0)
    assert not new._writer.is_alive() and old._process.is_alive()  # its engine not sent while the old one runs
    old.send(Stop())
    await rec.until(lambda: rec.ready is not None, timeout=120)
    assert not old._process.is_alive()
    # its counters go on from the engine it replaces (the server's /metrics never go back)
    assert (rec.ready.stats["num_steps"], rec.ready.stats["generation_tokens"]) == (1000, 5000)
    new.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, new.join, 10)


async def test_the_replacement_runs_in_the_spare_started_once_its_predecessor_was_ready(tiny_model_dir) -> None:
    """The spare did its imports while the engine served: the replacement loads the model only. A spare that died
    while it waited is not built on: the next host spawns a child of its own."""
    no_spare()
    rec = Recorder()
    old = EngineProcess(tiny_factory(tiny_model_dir), rec, asyncio.get_running_loop(), spare=True)
    old.start()
    await rec.until(lambda: rec.ready is not None, timeout=120)
    deadline = time.monotonic() + 120
    while (spare := engine_child._spare) is None or not spare.imported:  # started once the engine was ready
        assert time.monotonic() < deadline, "no spare, or its imports never ended"
        await asyncio.sleep(0.01)
    assert spare.process.pid != old.pid and spare.process.is_alive()
    os.kill(old.pid, signal.SIGKILL)
    await rec.until(lambda: rec.lost is not None)
    new_rec = Recorder()
    new = EngineProcess(tiny_factory(tiny_model_dir), new_rec, asyncio.get_running_loop(), replacement=True, after=old)
    assert engine_child._spare is None and new.pid == spare.process.pid  # taken
    new.start()
    await new_rec.until(lambda: new_rec.ready is not None, timeout=120)
    new.send(Add("short", _ids(8), SamplingParams(max_tokens=4, ignore_eos=True), fit_max_tokens=True))
    await new_rec.until(lambda: "short" in new_rec.finished())
    new.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, new.join, 10)

    engine_child.start_spare()
    dead = engine_child._spare
    assert dead is not None
    dead.process.kill()
    await asyncio.get_running_loop().run_in_executor(None, dead.process.join, 10)
    fresh = engine_child.take()
    assert fresh is not dead and not fresh.started and engine_child._spare is None


async def test_a_spare_that_cannot_start_leaves_the_engine_serving(tiny_model_dir, monkeypatch, caplog) -> None:
    """No file descriptors left for its pipes: the engine it was for goes on, and a replacement spawns its own."""

    class NoSpares(engine_child.EngineChild):
        def __init__(self, spare: bool = False) -> None:
            if spare:
                raise OSError(errno.EMFILE, "Too many open files")
            super().__init__()

    no_spare()
    monkeypatch.setattr(engine_child, "EngineChild", NoSpares)
    rec = Recorder()
    host = EngineProcess(tiny_factory(tiny_model_dir), rec, asyncio.get_running_loop(), spare=True)
    host.start()
    await rec.until(lambda: rec.ready is not None, timeout=120)
    host.send(Add("short", _ids(8), SamplingParams(max_tokens=4, ignore_eos=True), fit_max_tokens=True))
    await rec.until(lambda: "short" in rec.finished())
    assert rec.lost is None and rec.fatal is None and engine_child._spare is None
    assert "a spare engine process could not start" in caplog.text
    host.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, host.join, 30)


async def test_the_child_started_early_runs_the_first_engine(tiny_model_dir) -> None:
    """`sluice serve` starts the child before its own imports; the first host takes it, a later one spawns its own."""
    no_spare()
    engine_child.start_early()
    early = engine_child._early
    assert early is not None and early.process.pid is not None
    rec = Recorder()
    host = EngineProcess(tiny_factory(tiny_model_dir), rec, asyncio.get_running_loop())
    try:
        assert host.pid == early.process.pid and engine_child._early is None
        assert EngineProcess(tiny_factory(tiny_model_dir), Recorder(), asyncio.get_running_loop()).pid is None
    except BaseException:
        host.kill()  # it waits for its engine: the interpreter's exit would wait for it
        raise
    host.start()
    await rec.until(lambda: rec.ready is not None or rec.fatal is not None, timeout=120)
    host.send(Add("short", _ids(8), SamplingParams(max_tokens=4, ignore_eos=True), fit_max_tokens=True))
    await rec.until(lambda: "short" in rec.finished())
    host.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, host.join, 30)
    assert host._process.exitcode == 0 and rec.fatal is None and rec.lost is None


def test_signals_sent_while_the_child_starts_are_ignored() -> None:
    """Blocked from its exec until it ignores them: a Ctrl-C while it imports torch must not kill it. In a fresh
    interpreter: a process's first spawn starts multiprocessing's resource tracker too, which unblocks them."""
    script = """if True:
        import os, signal, time
        from service import engine_child
        engine_child.start_early()
        child = engine_child._early.process
        os.kill(child.pid, signal.SIGTERM)
        os.kill(child.pid, signal.SIGINT)
        def ignoring():  # its main thread has set SIGTERM's handler to SIG_IGN (bit 14 of SigIgn)
            status = open(f"/proc/{child.pid}/status").read()
            return int(status.split("SigIgn:")[1].split()[0], 16) >> (signal.SIGTERM - 1) & 1
        deadline = time.monotonic() + 120
        while child.is_alive() and not ignoring() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # what was pending has been delivered, to SIG_IGN
        print("alive" if child.is_alive() else f"ended {child.exitcode}")
    """
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc.stdout + proc.stderr[-2000:]


def test_a_server_that_fails_before_its_engine_starts_exits_at_once(tiny_model_dir) -> None:
    """Its early child held nothing yet: killed at exit (multiprocessing would wait for it, and it for its engine:
    forever)."""
    proc = subprocess.run([sys.executable, "-m", "service", "serve", "--model", str(tiny_model_dir),
                           "--tensor-parallel-size", "2", "--kv-offload-gb", "1"],  # argparse takes them, the engine not
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid configuration" in proc.stderr, proc.stderr[-2000:]


def test_the_engine_process_of_a_killed_server_ends_by_itself(tmp_path) -> None:
    """`kill -9` of `sluice serve`: nothing of it is left holding the model (or a device), its spare neither. (Idle, a
    child sees its command pipe end; busy, its thread watching the parent ends it.)"""
    server = start_server(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(engines := _engine_children(server.proc.pid)) < 2:  # the engine, and the spare started once ready
            assert time.monotonic() < deadline, f"no spare engine process: {engines}"
            time.sleep(0.05)
        assert len(engines) == 2, engines
        server.proc.kill()
        server.proc.wait(10)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in engines):
            assert time.monotonic() < deadline, f"the engine process outlived its server: {engines}"
            time.sleep(0.1)
    finally:
        server.stop()


def _engine_children(pid: int) -> list[int]:
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return "zombie"
