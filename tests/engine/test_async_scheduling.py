"""`async_scheduling`: step N+1 is scheduled and launched while step N runs, its new tokens placeholders that the
next forward reads on the device; step N's tokens are committed and its outputs made while step N+1's forward runs.
Every request's stream of outputs (tokens, text deltas, finishes, logprobs, generator states) equals the plain
loop's, one step later: under every policy, with preemption, the prefix cache, stop strings and stop tokens (a
request that ends where only its token says so had a row in the step after: dropped), seeds, unseeded sampling,
penalties, CUDA graphs' buffers, a step that fails and is run again, a request that fails alone, and aborts."""
from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, StepError
from engine.engine import DeviceError
from tests.engine.test_async_output import _break_detok, _run, params, streams
from tests.engine.test_cuda_graphs import uncaptured
from tests.engine.test_spec import _prompts

SETUPS = {
    "mixed": {},
    "prefill_first": {"scheduling": "prefill_first"},
    "static": {"scheduling": "static", "max_num_seqs": 3},
    "chunked-preempting": {"max_num_batched_tokens": 32, "num_kv_blocks": 24, "block_size": 8},
    "graphs": {"max_num_batched_tokens": 48},  # through the CUDA graphs' buffers (run eagerly on a CPU), decode and mixed
    # (a budget that chunks the prompts, so steps mix them with decodes)
    "host-tier": {"num_kv_blocks": 32, "block_size": 8, "kv_offload_gb": 0.01, "max_num_batched_tokens": 64},
}


def engine(model, ahead: bool, graphs: bool = False, **kw) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", **{"num_kv_blocks": 128, **kw},
                                 async_scheduling=ahead))
    if graphs:
        uncaptured(eng)
    return eng


def tokens(got: dict[str, list[tuple]]) -> dict[str, list[int]]:
    """`streams`' outputs as each request's tokens, however the steps chunked them."""
    return {rid: [t for o in outs for t in o[0]] for rid, outs in got.items()}


def all_params(eng: LLMEngine) -> list[SamplingParams]:
    """`params()` (greedy with logprobs, seeded top-p, stop strings, seeded penalties, EOS), an unseeded request,
    one (r6, on `_prompts()[2]`) that stops at the token id its greedy run reaches at its 6th token, and one (r7, on
    `R7_PROMPT`) that may not stop on the token its greedy run reaches at its 6th, nor on a stop string, before its
    9th (`min_tokens`)."""
    probe = eng.generate([_prompts()[2], R7_PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    stop_at, r7_at = (p.token_ids[5] for p in probe)
    return params() + [SamplingParams(max_tokens=20, temperature=0.9, ignore_eos=True),
                       SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
                       SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[r7_at], stop=["e"], min_tokens=8,
                                      ignore_eos=True)]


R7_PROMPT = list(range(300, 340))  # (a prompt of its own: one found in the prefix cache a step later may be chunked)


def _same_but_the_last_bits(a: dict[str, list[tuple]], b: dict[str, list[tuple]]) -> None:
    """`streams` outputs equal but for their logprobs, each within one step of its 4-decimal rounding. Blocks are
    published a step later under async scheduling, so a prompt may be computed again where the plain loop finds it
    cached; a chunk's attention may then take another kernel than the one that computed the cached KV (SDPA for a
    chunk of more than 16 tokens, the native kernel otherwise), equal to ~1e-7, which the rounding may show."""
    def parts(got: dict[str, list[tuple]]) -> tuple[dict, dict]:
        return ({rid: [o[:4] + o[5:] for o in outs] for rid, outs in got.items()},
                {rid: [o[4] for o in outs] for rid, outs in got.items()})
    (rest_a, lps_a), (rest_b, lps_b) = parts(a), parts(b)
    assert rest_a == rest_b  # tokens, texts, ends, seeds: all equal
    for rid, steps in lps_a.items():
        for x, y in zip(steps, lps_b[rid]):
            assert (x is None) == (y is None) and [t for t, _ in x or []] == [t for t, _ in y or []]
            assert all(abs(p - q) <= 2e-4 for (_, p), (_, q) in zip(x or [], y or [])), (rid, x, y)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_same_streams_as_the_plain_loop(tiny_model_dir, setup, caplog):
    prompts = _prompts()
    prompts = prompts + [prompts[0], prompts[2], R7_PROMPT]
    plain = engine(tiny_model_dir, False, graphs=setup == "graphs", **SETUPS[setup])
    ahead = engine(tiny_model_dir, True, graphs=setup == "graphs", **SETUPS[setup])
    assert ahead._pipelined and not plain._pipelined
    ps = all_params(plain)
    assert all_params(ahead) == ps
    read, mixed_reads = [], []  # steps whose forward read tokens the step before sampled, on the device
    staged, launched = ahead.runner.graphs.stage if setup == "graphs" else None, ahead.runner.launch
    if staged:
        def stage(inputs, cu, rows, fill=None):
            read.append(fill is not None)
            mixed_reads.append(fill is not None and cu[-1] > len(cu) - 1)  # beside a prompt chunk
            return staged(inputs, cu, rows, fill)
        ahead.runner.graphs.stage = stage
    else:
        ahead.runner.launch = lambda b, s, p=None: (read.append(bool(p)), launched(b, s, p))[1]
    for _ in range(2):  # the second round meets the first's prompts in the prefix cache
        a, b = streams(plain, prompts, ps), streams(ahead, prompts, ps)
        if a != b:  # only where it computed a prompt's tokens the plain loop found cached: then to the last bits
            assert ahead.stats()["prompt_tokens_computed"] > plain.stats()["prompt_tokens_computed"]
            _same_but_the_last_bits(a, b)
        assert all(s[-1][2] for s in a.values()) and a["r6"][-1][3] == "stop" and len(a["r6"]) < 30
        assert len(tokens(a)["r7"]) > 8 and ps[7].stop_token_ids[0] not in tokens(a)["r7"][:8]
    assert sum(read) > 20 and "retrying" not in caplog.text  # (a failed forward would be run again, and hide it)
    assert setup != "graphs" or sum(mixed_reads) > 0
    if setup == "chunked-preempting":
        assert ahead.stats()["num_preemptions"] > 0
    if setup == "host-tier":  # the second round's prompts come back from the host tier (copied on the forward thread)
        assert ahead.stats()["host_cache_hits"] > 0
    assert ahead.stats()["generation_tokens"] == plain.stats()["generation_tokens"]
    assert ahead.stats()["prompt_tokens_computed"] >= plain.stats()["prompt_tokens_computed"]  # (blocks are
    # published a step later: a prompt admitted in the very next step may compute what the plain loop finds cached)
    ahead.close()


def test_the_next_step_is_launched_before_the_last_ones_tokens_are_known(tiny_model_dir):
    """After each step call a step is in flight; its requests hold a placeholder for the token it samples. The
    outputs come a step later than the plain loop's and nothing is lost at the end."""
    eng = engine(tiny_model_dir, True)
    eng.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert eng.step() == []
    req = eng.requests["a"]
    assert eng._inflight is not None and req.num_placeholders == 1 and req.token_ids[-1] == -1
    assert req.num_computed_tokens == 4  # counted computed ahead of time: the next step decodes from there
    first = eng.step()
    assert [o.new_token_ids for o in first] == [[req.token_ids[4]]] and req.token_ids[4] >= 0
    assert req.num_placeholders == 1 and req.num_computed_tokens == 5  # the second token's step is in flight
    rest = []
    while eng.has_unfinished():
        rest += eng.step()
    assert [len(o.new_token_ids) for o in rest] == [1, 1] and rest[-1].finish_reason == "length"
    assert eng._inflight is None and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_request_the_next_step_would_end_by_length_is_not_scheduled(tiny_model_dir):
    """Its last token is in flight: the step launched beside it leaves it out (nothing more to compute)."""
    eng = engine(tiny_model_dir, True)
    eng.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    eng.add_request("b", [9, 10, 11], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()
    assert [r.request_id for r in eng._inflight.batch.reqs] == ["b"]


def _failing_forward(eng: LLMEngine, at: int, who: str | None = None) -> None:
    """The `at`-th launched forward raises once (a transient failure); with `who`, every forward from the `at`-th
    that holds that request raises (its computation fails)."""
    launch, n = eng.runner.launch, [0]

    def flaky(batch, samples, placeholders=None):
        n[0] += 1
        forward = launch(batch, samples, placeholders)
        if (n[0] == at and who is None) or (who and n[0] >= at and any(r.request_id == who for r in batch.reqs)):
            def failing():
                raise RuntimeError("injected")
            return failing
        return forward
    eng.runner.launch = flaky


GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
RANDOM = SamplingParams(max_tokens=30, temperature=0.9, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=30, temperature=0.9, seed=5, presence_penalty=0.5, ignore_eos=True)


def test_a_failed_step_is_undone_and_run_again(tiny_model_dir):
    """A step's forward fails once: the step launched after it (on tokens never sampled) is dropped, the failed one
    is undone (its computed tokens, its placeholders) and run again as the plain loop runs a failed step again: the
    streams, unseeded draws included, are the plain loop's."""
    runs = [_run(engine(tiny_model_dir, ahead), [GREEDY, RANDOM, SEEDED], lambda e: _failing_forward(e, 5))
            for ahead in (False, True)]
    assert runs[0] == runs[1] and runs[1][1] == []
    assert all(s[-1][2] == "length" for s in runs[1][0].values())


def test_a_request_that_fails_alone(tiny_model_dir):
    """r1's computation fails from the 5th forward on: `StepError['r1']` after retry and halving, what came out for
    it before is reported, and the others' streams are the plain loop's."""
    plain, ahead = (_run(engine(tiny_model_dir, a), [GREEDY, SEEDED, RANDOM], lambda e: _failing_forward(e, 5, "r1"))
                    for a in (False, True))
    assert plain[1] == ahead[1] == ["StepError['r1']"]
    assert plain[0] == ahead[0] and 0 < sum(len(o[0]) for o in plain[0]["r1"]) < 30


def test_a_request_whose_output_fails(tiny_model_dir):
    """r1's detokenizer raises on its 6th token (its step's commit, while the next step runs): it ends with the
    error, is not sampled in the step in flight (the others' unseeded draws stay where the plain loop has them)."""
    a, b = (_run(engine(tiny_model_dir, ahead), [RANDOM, RANDOM, RANDOM], lambda e: _break_detok(e, "r1", 6))
            for ahead in (False, True))
    assert a[0]["r1"][-1][2:] == ("abort", "RuntimeError: detokenizer broke") and len(a[0]["r1"]) == 6
    assert a == b


def test_aborts(tiny_model_dir):
    """An abort ends a request at once; the token its running step samples is never reported. The others' streams
    are the plain loop's."""
    prompts, ps = _prompts()[:3], [GREEDY, SEEDED, RANDOM]
    a = streams(engine(tiny_model_dir, False), prompts, ps, abort_at={5: "r0", 9: "r1"})
    b = streams(engine(tiny_model_dir, True), prompts, ps, abort_at={5: "r0", 9: "r1"})
    assert a["r2"] == b["r2"]
    for rid in ("r0", "r1"):
        ta, tb = tokens({rid: a[rid]})[rid], tokens({rid: b[rid]})[rid]
        assert b[rid][-1][3] == a[rid][-1][3] == "abort" and ta[: len(tb)] == tb


@pytest.mark.parametrize("method, async_output", [("ngram", False), ("ngram", True), ("draft", False)])
def test_speculation_drafts_in_plain_steps_and_large_batches_run_ahead(tiny_model_dir, caplog, method, async_output):
    """Under speculative decoding a step that may draft (fewer running requests than
    `speculative_disable_by_batch_size`) runs as the plain loop's, once the step in flight is committed; larger
    batches are scheduled ahead and draft nothing (a draft model catches up on their tokens when it drafts again).
    As the batch shrinks it crosses over. Greedy and seeded requests come out as without speculation or scheduling
    ahead."""
    prompts = _prompts() + _prompts(5)
    ps = [SamplingParams(max_tokens=12 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    ps[3] = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    ps[6] = SamplingParams(max_tokens=20, temperature=0.0, stop=["e"], ignore_eos=True)
    plain = engine(tiny_model_dir, False)
    want = tokens(streams(plain, prompts, ps))
    eng = engine(tiny_model_dir, True, speculative="ngram" if method == "ngram" else f"draft:{tiny_model_dir}",
                 speculative_adaptive=False,
                 speculative_disable_by_batch_size=4, async_output_proc=async_output)
    assert eng._pipelined and "does not run" not in caplog.text
    spec, launch = eng.scheduler.spec, eng.runner.launch
    drafted_over_placeholders, ahead, draft = [], [], spec.draft
    spec.draft = lambda r: drafted_over_placeholders.append(r.num_placeholders) or draft(r)
    eng.runner.launch = lambda b, s, p=None: (ahead.append(bool(p)), launch(b, s, p))[1]
    assert tokens(streams(eng, prompts, ps)) == want
    assert eng.stats()["spec_draft_tokens"] > 0 and drafted_over_placeholders and not any(drafted_over_placeholders)
    assert sum(ahead) > 5 and "retrying" not in caplog.text
    eng.check_integrity()
    eng.close()


def _schedule_fails_once(eng: LLMEngine, at: int) -> None:
    schedule, n = eng.scheduler.schedule, [0]

    def flaky(**kw):
        n[0] += 1
        if n[0] == at:
            raise RuntimeError("the scheduler failed")
        return schedule(**kw)
    eng.scheduler.schedule = flaky


def test_a_step_that_fails_before_it_launches_keeps_the_running_one(tiny_model_dir):
    """The scheduler raises once while a step runs: that `step()` raises, the running step stays in flight and the
    next `step()` commits it; the streams are the plain loop's (whose step raised the same way)."""
    a, b = (_run(engine(tiny_model_dir, ahead), [GREEDY, SEEDED, RANDOM], lambda e: _schedule_fails_once(e, 6))
            for ahead in (False, True))
    assert a == b and a[1] == ["RuntimeError('the scheduler failed')"]


def test_a_rebuild_that_keeps_the_pool_waits_for_the_step_in_flight(tiny_model_dir):
    """A failed engine's step may still be queued on its forward thread; it writes the pool a rebuilt engine keeps,
    so the rebuild waits for it first."""
    eng = engine(tiny_model_dir, True)
    eng.add_request("a", _prompts()[0], GREEDY)
    for _ in range(3):
        eng.step()
    inflight, done = eng._inflight, []
    eng._forwards.submit(lambda: (time.sleep(0.3), done.append(True)))  # still queued when the engine is rebuilt
    new = eng.rebuilt(keep_cache=True)
    assert inflight.forward.done() and done == [True]
    new.add_request("b", _prompts()[1], GREEDY)
    while new.has_unfinished():
        new.step()
    new.close()


def test_an_itl_target_sizes_chunks_from_the_loops_period(tiny_model_dir):
    """With `itl_slo_ms` the step-cost model learns from each step's period (one launch to the next) and sizes
    prompt chunks by it. The chunks depend on timing (in both loops), so only the tokens are compared."""
    prompts, ps = _prompts(), [GREEDY] * len(_prompts())
    plain = streams(engine(tiny_model_dir, False, itl_slo_ms=40.0, max_num_batched_tokens=64), prompts, ps)
    eng = engine(tiny_model_dir, True, itl_slo_ms=40.0, max_num_batched_tokens=64)
    assert tokens(streams(eng, prompts, ps)) == tokens(plain)
    assert eng.scheduler.step_cost.steps > 0


def test_a_failed_step_whose_request_the_next_step_preempted(tiny_model_dir):
    """A tight pool: scheduling the next step preempts requests of the running one. When the running one then
    fails, its preempted requests are left out of the rerun (nothing of them is computed any more; they come back
    from the waiting queue), and the streams are still the plain loop's."""
    tight = {"max_num_batched_tokens": 32, "num_kv_blocks": 24, "block_size": 8}
    ps = [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY]
    probe, launches = engine(tiny_model_dir, True, **tight), []  # which launches come after a preempting schedule
    launch = probe.runner.launch
    probe.runner.launch = lambda b, s, p=None: (launches.append(probe.scheduler.num_preemptions), launch(b, s, p))[1]
    _run(probe, ps)
    preempting = [i for i in range(1, len(launches)) if launches[i] > launches[i - 1]]
    assert preempting
    preempted_in_failed = []
    for at in preempting[:4]:  # the step running while the one launched after it (`at + 1`) preempted
        ahead = engine(tiny_model_dir, True, **tight)
        undo = ahead._undo
        ahead._undo = lambda f: (preempted_in_failed.append(any(r.status.value == "waiting" for r, _ in f.advanced)),
                                 undo(f))[1]
        runs = [_run(eng, ps, lambda e: _failing_forward(e, at))
                for eng in (engine(tiny_model_dir, False, **tight), ahead)]
        assert runs[0] == runs[1] and runs[1][1] == [], at
    assert any(preempted_in_failed)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "static"])
@pytest.mark.parametrize("culprit", [False, True])
def test_the_prompts_a_dropped_step_admitted_are_admitted_again(tiny_model_dir, policy, culprit):
    """A step fails (once, or for good: r0 fails alone, `StepError`); the step launched after it, which admitted a
    new prompt, is dropped: the prompt goes back to the front of the waiting queue (the policies that never chunk
    schedule a prompt only on admission) and runs."""
    kw = {"scheduling": policy, **({"max_num_seqs": 3} if policy == "static" else {})}
    eng = engine(tiny_model_dir, True, **kw)
    eng.add_request("r0", _prompts()[0], GREEDY)
    _failing_forward(eng, 4, "r0" if culprit else None)
    for _ in range(4):
        eng.step()
    eng.add_request("late", _prompts()[1], GREEDY)  # admitted by the step launched next, then dropped
    got: dict[str, int] = {}
    errors = []
    for _ in range(300):
        if not eng.has_unfinished():
            break
        try:
            outs = eng.step()
        except StepError as e:
            errors.append(e.request_ids)
            outs = e.outputs
        for o in outs:
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    assert got["late"] == 30 and not eng.has_unfinished()
    assert errors == ([["r0"]] if culprit else []) and (culprit or got["r0"] == 30 - 3)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_failed_host_tier_copy_is_a_device_error(tiny_model_dir, ahead):
    """A copy between the pool and the host tier fails: the blocks it fills count as cached already, so the step
    raises `DeviceError` (a rebuilt engine does not keep this cache), with or without async scheduling."""
    eng = engine(tiny_model_dir, ahead, **SETUPS["host-tier"])
    copies, n = eng.runner.copy_blocks, [0]

    def failing(offloads, loads):
        n[0] += 1
        if n[0] == 3:
            raise RuntimeError("copy failed")
        return copies(offloads, loads)
    eng.runner.copy_blocks = failing
    with pytest.raises(DeviceError, match="host tier"):
        for _ in range(2):
            streams(eng, _prompts() + [_prompts()[0], _prompts()[2]], all_params(eng))


def test_a_request_failed_between_steps_is_not_sampled(tiny_model_dir):
    """The server fails a request between two steps (its output could not be delivered: `fail()`) while the next
    step, launched already, holds it: that step does not sample it, so the other requests' unseeded draws are the
    plain loop's."""
    def run(ahead: bool) -> dict[str, list[int]]:
        eng = engine(tiny_model_dir, ahead)
        for i in range(3):
            eng.add_request(f"r{i}", _prompts()[i], RANDOM)
        got: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.request_id == "r1" and len(got["r1"]) == 6 and o.new_token_ids:
                    eng.fail("r1", RuntimeError("delivery failed"))
        return got
    plain, ahead = run(False), run(True)
    assert len(plain["r1"]) == 6 and plain == ahead
