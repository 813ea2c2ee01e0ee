"""`async_output_proc`: a step's outputs are made while the next step's forward runs (on the forward thread), one
step later than without it, and are otherwise the same: every request's stream of outputs (tokens, text deltas,
finishes, logprobs, generator states) equals the plain loop's, under every policy, with preemption, speculation,
stop strings, seeds, penalties, aborts and a request that fails while the next step runs."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, StepError
from tests.engine.test_spec import _prompts

SETUPS = {
    "mixed": {},
    "prefill_first": {"scheduling": "prefill_first"},
    "static": {"scheduling": "static", "max_num_seqs": 3},
    "chunked-preempting": {"max_num_batched_tokens": 32, "num_kv_blocks": 24, "block_size": 8},
    "ngram": {"speculative": "ngram", "speculative_adaptive": False, "speculative_disable_by_batch_size": 64},
    "draft": {"speculative": "draft:", "speculative_adaptive": False, "speculative_disable_by_batch_size": 64},
}


def params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["e", " t"], ignore_eos=True),  # stop strings
        SamplingParams(max_tokens=33, temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0),
    ]


def streams(engine: LLMEngine, prompts, ps, abort_at: dict[int, str] | None = None) -> dict[str, list[tuple]]:
    """Every request's outputs in order, stepping until all finish; `abort_at`: step call -> request to abort
    before it."""
    for i, (p, sp) in enumerate(zip(prompts, ps)):
        engine.add_request(f"r{i}", p, sp)
    got: dict[str, list[tuple]] = {}
    calls = 0
    while engine.has_unfinished():
        if abort_at and calls in abort_at:
            engine.abort(abort_at[calls])
        calls += 1
        for o in engine.step():
            rng = o.rng_state
            lps = None if not o.logprobs else [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs]
            got.setdefault(o.request_id, []).append(
                (tuple(o.new_token_ids), o.text_delta, o.finished, o.finish_reason, lps, rng, o.error))
        assert calls < 2000
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return got


def engine(model, overlap: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu",
                                  **{"num_kv_blocks": 128, **kw}, async_output_proc=overlap))


@pytest.mark.parametrize("setup", list(SETUPS))
def test_same_streams_as_the_plain_loop(tiny_model_dir, draft_dir, setup):
    prompts = _prompts()
    config = dict(SETUPS[setup])
    if setup == "draft":
        config["speculative"] = f"draft:{draft_dir}"
    plain = engine(tiny_model_dir, False, **config)
    overlapped = engine(tiny_model_dir, True, **config)
    assert overlapped._forwards is not None and plain._forwards is None
    for _ in range(2):  # the second round meets the first's prompts in the prefix cache
        a, b = streams(plain, prompts, params()), streams(overlapped, prompts, params())
        assert a == b
        assert all(s[-1][2] for s in a.values()) and any(s[-1][3] == "stop" for s in a.values())
    if setup == "chunked-preempting":
        assert overlapped.stats()["num_preemptions"] > 0
    if setup in ("ngram", "draft"):
        assert overlapped.stats()["spec_accepted_tokens"] > 0
    overlapped.close()


def test_outputs_come_one_step_later(tiny_model_dir):
    """The first token is sampled by the first step and reported by the second; nothing is lost at the end."""
    eng = engine(tiny_model_dir, True)
    eng.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert eng.step() == []  # the prefill's token is held back, to be made while the next step's forward runs
    first = eng.step()
    assert [o.new_token_ids for o in first] == [[eng.requests["a"].token_ids[4]]]
    rest = []
    while eng.has_unfinished():
        rest += eng.step()
    assert [len(o.new_token_ids) for o in rest] == [1, 1] and rest[-1].finish_reason == "length"


def test_abort_reports_what_was_made_before_it(tiny_model_dir):
    prompts, ps = _prompts()[:3], params()[:3]
    a = streams(engine(tiny_model_dir, False), prompts, ps, abort_at={5: "r0", 9: "r1"})
    b = streams(engine(tiny_model_dir, True), prompts, ps, abort_at={5: "r0", 9: "r1"})
    assert a["r0"][-1][3] == "abort" and a["r1"][-1][3] == "abort"
    assert a == b


def _break_detok(eng: LLMEngine, rid: str, at: int) -> None:
    """`rid`'s detokenizer raises on its `at`-th token."""
    detok, calls = eng.requests[rid].detok, []

    def broken(token):
        calls.append(token)
        if len(calls) == at:
            raise RuntimeError("detokenizer broke")
        return type(detok).add_token(detok, token)
    detok.add_token = broken


def _run(eng: LLMEngine, ps: list[SamplingParams], setup=None) -> tuple[dict[str, list[tuple]], list[str]]:
    for i, (p, sp) in enumerate(zip(_prompts()[:len(ps)], ps)):
        eng.add_request(f"r{i}", p, sp)
    if setup:
        setup(eng)
    got: dict[str, list[tuple]] = {}
    errors = []
    while eng.has_unfinished():
        try:
            outs = eng.step()
        except StepError as e:  # what came out for its requests before it failed comes with it
            errors.append(f"StepError{e.request_ids}")
            outs = e.outputs
        except Exception as e:
            errors.append(repr(e))
            continue
        for o in outs:
            got.setdefault(o.request_id, []).append((tuple(o.new_token_ids), o.text_delta, o.finish_reason, o.error))
    eng.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return got, errors


RANDOM = SamplingParams(max_tokens=30, temperature=0.9, ignore_eos=True)  # unseeded: the engine's one generator
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def test_a_request_whose_output_fails_while_the_next_step_runs_fails_alone(tiny_model_dir):
    """r1's detokenizer raises on its 6th token: made while the next step, which holds it, runs. It ends with an
    error, its blocks go back, it is not sampled in the step in flight (so the others' random draws stay where the
    plain loop has them), and the others go on as without it."""
    a, b = (_run(engine(tiny_model_dir, overlap), [RANDOM, RANDOM, RANDOM], lambda e: _break_detok(e, "r1", 6))
            for overlap in (False, True))
    assert a[0]["r1"][-1][2:] == ("abort", "RuntimeError: detokenizer broke") and len(a[0]["r1"]) == 6
    assert a == b


def _failing_launch(eng: LLMEngine, at: int, when: str) -> None:
    """The `at`-th step's launch raises ("launch") or its forward does ("forward"), once: a transient failure."""
    launch, n = eng.runner.launch, [0]

    def flaky(batch, samples):
        n[0] += 1
        if n[0] == at and when == "launch":
            raise RuntimeError("transient")
        forward = launch(batch, samples)
        if n[0] == at:
            def failing():
                raise RuntimeError("transient")
            return failing
        return forward
    eng.runner.launch = flaky


@pytest.mark.parametrize("when", ["launch", "forward"])
def test_a_retried_step_loses_no_output(tiny_model_dir, when):
    """A step whose launch or forward fails once is retried (`_recover`): the outputs held back from the step before
    still come out, in order; with a request failing in them at the same time, the retry leaves it out and every
    other request keeps its own tokens."""
    for extra in (None, "r1"):
        runs = []
        for overlap in (False, True):
            def setup(eng, overlap=overlap):
                _failing_launch(eng, 5, when)
                if extra:  # fails while step 5 runs (async), or in step 4's outputs (plain): the same for a client
                    _break_detok(eng, extra, 4)
            runs.append(_run(engine(tiny_model_dir, overlap), [GREEDY, RANDOM, GREEDY], setup))
        assert runs[0] == runs[1]
        assert runs[1][1] == [] and all(s[-1][2] in ("length", "abort") for s in runs[1][0].values())


def test_a_request_that_fails_alone_gets_its_last_output_with_its_error(tiny_model_dir):
    """r1's computation fails from the 5th step on (`StepError`, after retry and halving): what the plain loop
    reported for it before, async_output_proc reports too, the last of it with the error (`StepError.outputs`),
    and the others' streams are the same."""
    def poison(eng: LLMEngine) -> None:
        launch, n = eng.runner.launch, [0]

        def poisoned(batch, samples):
            n[0] += 1
            forward = launch(batch, samples)
            if n[0] >= 5 and any(r.request_id == "r1" for r in batch.reqs):
                def failing():
                    raise RuntimeError("r1 poisons the forward")
                return failing
            return forward
        eng.runner.launch = poisoned

    plain, overlapped = (_run(engine(tiny_model_dir, overlap), [GREEDY] * 3, poison) for overlap in (False, True))
    assert plain[1] == overlapped[1] == ["StepError['r1']"]
    assert plain[0] == overlapped[0] and 0 < sum(len(o[0]) for o in plain[0]["r1"]) < 30


def test_abort_of_a_request_whose_held_back_output_fails(tiny_model_dir):
    """Its output fails as `abort()` makes it: one finished output (the failure's), not a second abort after it."""
    eng = engine(tiny_model_dir, True)
    eng.add_request("r0", _prompts()[0], GREEDY)
    _break_detok(eng, "r0", 3)
    outs = [eng.step() for _ in range(3)]  # the 3rd token is held back after the third step
    eng.abort("r0")
    outs.append(eng.step())
    finished = [o for step in outs for o in step if o.finished]
    assert [(o.finish_reason, o.error) for o in finished] == [("abort", "RuntimeError: detokenizer broke")]
    assert not eng.has_unfinished()


def test_a_retried_step_whose_only_request_failed_meanwhile(tiny_model_dir):
    """The only request fails while its step runs, and that forward fails once: nothing is left to retry, and no
    `StepError` names nobody."""
    eng = engine(tiny_model_dir, True)
    got, errors = _run(eng, [GREEDY], lambda e: (_failing_launch(e, 4, "forward"), _break_detok(e, "r0", 3)))
    assert errors == [] and got["r0"][-1][2:] == ("abort", "RuntimeError: detokenizer broke")
