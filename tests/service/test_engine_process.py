"""The engine in a process of its own (service/engine_process.py, `--engine-process`): the same commands and listener
calls as the engine thread, over pipes, and the ways a child can end: told to stop, a model that cannot load, killed,
or its server gone."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from functools import partial

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from service.engine_process import EngineProcess
from service.engine_thread import Abort, Add, Stop
from tests.service.test_engine_thread import LONG, MAX_LEN, Recorder, _ids


def tiny_factory(model_dir) -> partial:
    return partial(LLMEngine, EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64,
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


async def test_commands_in_results_out_and_a_stop_ends_it_quietly(started) -> None:
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


async def test_a_process_whose_server_is_gone_stops_by_itself(started) -> None:
    host, rec = started
    host.send(Add("long", _ids(8), LONG, fit_max_tokens=True))
    await rec.until(lambda: len(rec.steps) >= 2)
    host._commands.close()  # as the server's death closes it: no Stop ever comes
    deadline = time.monotonic() + 30
    while host._process.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert host._process.exitcode == 0
