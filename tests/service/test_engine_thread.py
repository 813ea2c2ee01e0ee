"""The engine thread (service/engine_thread.py) on its own: typed commands in, results scheduled on the loop, over a
real tiny engine. The listener records what reaches the loop; faults come from swapping the engine's runner."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from service.engine_thread import Abort, Add, EngineReady, EngineThread, Failure, StepResult, Stop

MAX_LEN = 256
LONG = SamplingParams(max_tokens=MAX_LEN - 16, temperature=0.0, ignore_eos=True)  # hundreds of steps by construction


class Recorder:
    """The loop side: every call lands here, on the loop, in order."""

    def __init__(self) -> None:
        self.ready: EngineReady | None = None
        self.steps: list[StepResult] = []
        self.calls = 0  # of on_steps
        self.fatal: str | None = None
        self.lost: str | None = None
        self.changed = asyncio.Event()

    def on_ready(self, ready: EngineReady) -> None:
        self.ready = ready
        self.changed.set()

    def on_steps(self, results: list[StepResult]) -> None:
        assert results
        self.steps += results
        self.calls += 1
        self.changed.set()

    def on_fatal(self, message: str) -> None:
        self.fatal = message
        self.changed.set()

    def on_lost(self, message: str, kv_intact: bool) -> None:
        self.lost = message
        self.kv_intact = kv_intact
        self.changed.set()

    def finished(self) -> dict[str, str]:
        return {d.request_id: d.finish_reason for s in self.steps for d in s.deliveries if d.finish_reason}

    def failures(self) -> dict[str, Failure]:
        return {f.request_id: f for s in self.steps for f in s.failures}

    async def until(self, condition, timeout: float = 60.0) -> None:
        async def wait() -> None:
            while not condition():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout)


@pytest.fixture
async def started(tiny_model_dir):
    engines: list[LLMEngine] = []

    def factory() -> LLMEngine:
        engines.append(LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                              max_model_len=MAX_LEN)))
        return engines[0]

    recorder = Recorder()
    thread = EngineThread(factory, recorder, asyncio.get_running_loop())
    thread.start()
    await recorder.until(lambda: recorder.ready is not None or recorder.fatal is not None)
    assert recorder.ready is not None and recorder.ready.max_model_len == MAX_LEN
    yield thread, recorder, engines[0]
    thread.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)


def _ids(n: int, base: int = 3) -> list[int]:
    return [base + i % 500 for i in range(n)]


async def test_add_runs_to_the_end_and_abort_stops_a_running_request(started) -> None:
    thread, rec, eng = started
    thread.send(Add("short", _ids(8), SamplingParams(max_tokens=4, ignore_eos=True), fit_max_tokens=True))
    thread.send(Add("long", _ids(8, 100), LONG, fit_max_tokens=True))
    await rec.until(lambda: "short" in rec.finished())
    assert rec.finished()["short"] == "length" and "long" not in rec.finished()
    thread.send(Abort("long"))
    thread.send(Abort("nobody"))  # unknown (or already finished) ids are a no-op
    await rec.until(lambda: "long" in rec.finished())
    assert rec.finished()["long"] == "abort" and not rec.failures()
    await rec.until(lambda: rec.steps[-1].stats["num_running"] == 0)
    assert not eng.requests  # the engine is the one registry: nothing is left behind


def hold_the_loop(host, steps: int) -> None:
    """Keeps the loop from its next turn (no await) until the engine has completed `steps` more steps."""
    until = host.steps_done + steps
    while host.steps_done < until:
        time.sleep(0.002)  # the engine thread runs meanwhile


async def test_steps_the_loop_has_not_taken_reach_it_in_one_call_in_order(started) -> None:
    thread, rec, eng = started
    thread.send(Add("long", _ids(8), LONG, fit_max_tokens=True))
    await rec.until(lambda: rec.steps)
    calls, taken = rec.calls, len(rec.steps)
    hold_the_loop(thread, 4)  # each posted step waits for the loop meanwhile: at least 3 of them
    await asyncio.sleep(0)  # one turn: the call that takes them all runs before this task resumes
    assert rec.calls == calls + 1 and len(rec.steps) - taken >= 3
    starts = [s.step_start for s in rec.steps]
    assert starts == sorted(starts)
    await rec.until(lambda: "long" in rec.finished())
    ids = [t for s in rec.steps for d in s.deliveries for t in d.token_ids]
    thread.send(Stop())
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
    assert ids == eng.generate([_ids(8)], LONG)[0].token_ids  # every token, once, in order


async def test_the_engine_decides_admission(started) -> None:
    thread, rec, _ = started
    thread.send(Add("strict", _ids(100), SamplingParams(max_tokens=MAX_LEN), fit_max_tokens=False))
    thread.send(Add("capped", _ids(MAX_LEN - 2), SamplingParams(max_tokens=50, ignore_eos=True), fit_max_tokens=True))
    thread.send(Add("rest", _ids(MAX_LEN - 5), SamplingParams(max_tokens=None, ignore_eos=True), fit_max_tokens=True))
    thread.send(Add("bad-id", [10**6], SamplingParams(), fit_max_tokens=True))
    await rec.until(lambda: {"capped", "rest"} <= set(rec.finished()) and {"strict", "bad-id"} <= set(rec.failures()))
    strict, bad = rec.failures()["strict"], rec.failures()["bad-id"]
    assert strict.code == "prompt_too_long" and "at most 156 fit" in strict.message
    assert bad.code == "invalid_message"
    tokens = {d.request_id: 0 for s in rec.steps for d in s.deliveries}
    for s in rec.steps:
        for d in s.deliveries:
            tokens[d.request_id] += d.num_new_tokens
    assert (tokens["capped"], tokens["rest"]) == (2, 5)  # capped to, and resolved as, the room the prompt leaves


async def test_a_failing_request_fails_alone_and_its_bystanders_run_on(started) -> None:
    thread, rec, eng = started
    run = eng.runner.run

    def run_or_fail(batch, samples):
        if any(r.request_id == "victim" for r in batch.reqs):
            raise RuntimeError("injected fault")
        return run(batch, samples)

    eng.runner.run = run_or_fail
    for i in range(4):
        thread.send(Add(f"by{i}", _ids(8, 50 * i), SamplingParams(max_tokens=6, ignore_eos=True), fit_max_tokens=True))
    thread.send(Add("victim", _ids(8), SamplingParams(max_tokens=4), fit_max_tokens=True))
    await rec.until(lambda: "victim" in rec.failures() and len(rec.finished()) == 4)
    assert rec.failures()["victim"].code == "internal" and set(rec.failures()) == {"victim"} and rec.fatal is None
    assert set(rec.finished().values()) == {"length"}  # every bystander ran to its end
    thread.send(Add("after", _ids(8, 200), SamplingParams(max_tokens=4, ignore_eos=True), fit_max_tokens=True))
    await rec.until(lambda: "after" in rec.finished())
    assert rec.finished()["after"] == "length"


async def test_a_failure_outside_the_model_ends_the_thread_as_lost(started) -> None:
    """Not a model failure: nothing the engine can attribute to a request. Its state can no longer be trusted, so
    the thread reports the engine lost (the loop resumes its requests elsewhere) and ends; it fails no request."""
    thread, rec, eng = started
    thread.send(Add("long", _ids(8), LONG, fit_max_tokens=True))
    await rec.until(lambda: any(d.request_id == "long" and d.num_new_tokens for s in rec.steps for d in s.deliveries))

    def broken(*args, **kwargs):
        raise RuntimeError("scheduler broken")

    eng.scheduler.schedule = broken
    await rec.until(lambda: rec.lost is not None)
    assert "scheduler broken" in rec.lost and rec.fatal is None and not rec.failures()
    assert rec.kv_intact  # the model never ran wrong: a new engine may keep the cache
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
    assert not thread._thread.is_alive() and "long" in eng.requests  # intact, for whoever resumes it


async def test_an_abandoned_thread_reaches_the_loop_no_more(started) -> None:
    """Even the calls it scheduled before `abandon` are dropped when they run; it ends after its step."""
    thread, rec, eng = started
    thread.send(Add("long", _ids(8), LONG, fit_max_tokens=True))
    await rec.until(lambda: len(rec.steps) >= 3)
    thread.abandon()
    seen = len(rec.steps)
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
    await asyncio.sleep(0.1)  # anything it queued has run by now
    assert len(rec.steps) == seen and not thread._thread.is_alive() and rec.lost is None


async def test_a_request_whose_output_fails_fails_alone(started, monkeypatch) -> None:
    """Its detokenizer raises (here: a prompt ending in token 999): a Failure for it alone, the thread goes on."""
    from engine.detokenizer import IncrementalDetokenizer

    thread, rec, eng = started
    add_token = IncrementalDetokenizer.add_token

    def broken(self, token):
        if 999 in self.ids[:6]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "cannot decode")
        return add_token(self, token)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", broken)
    thread.send(Add("bad", _ids(8) + [999], SamplingParams(max_tokens=6, ignore_eos=True), fit_max_tokens=True))
    thread.send(Add("good", _ids(8, 100), SamplingParams(max_tokens=6, ignore_eos=True), fit_max_tokens=True))
    await rec.until(lambda: "bad" in rec.failures() and "good" in rec.finished())
    assert rec.failures()["bad"].code == "internal" and rec.finished()["good"] == "length"
    assert rec.lost is None and rec.fatal is None and not eng.requests


async def test_a_device_that_fails_everything_loses_the_engine_and_its_kv(started) -> None:
    thread, rec, eng = started
    thread.send(Add("long", _ids(8), LONG, fit_max_tokens=True))
    await rec.until(lambda: any(d.request_id == "long" and d.num_new_tokens for s in rec.steps for d in s.deliveries))

    def dead(batch, samples):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng.runner.device_ok = lambda: False
    eng.runner.run = dead
    await rec.until(lambda: rec.lost is not None)
    assert "DeviceError" in rec.lost and not rec.kv_intact and not rec.failures()


def test_a_deliverys_logprobs_go_unnamed_in_arrays(tiny_model_dir) -> None:
    """The engine thread names no token: a delivery's logprobs are the engine's ids and floats in four arrays (kept
    until a long answer ends, four objects for the cyclic collector, not thousands of tuples), named by the server as
    a response takes them, to what the tokenizer says."""
    from array import array

    from engine.processor import InputProcessor
    from service.engine_thread import _delivery

    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256))
    eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, logprobs=5))
    scores, ids = [], []
    while eng.has_unfinished():
        for o in eng.step():
            ids += o.new_token_ids
            if (d := _delivery(o)).logprobs is not None:
                scores.append(d.logprobs)
    assert all(isinstance(a, array) for s in scores for a in s)
    tt = InputProcessor(tiny_model_dir, 1024, 256).token_text.freeze()
    named = [lp for s in scores for lp in s.named(tt)]
    assert [lp[0] for lp in named] == ids and all(len(lp[4]) == 5 for lp in named)
    assert [(lp[1], lp[2]) for lp in named] == [(tt.tokenizer.convert_ids_to_tokens(t).replace("Ġ", " "),
                                                 tt.bytes(t)) for t in ids]
