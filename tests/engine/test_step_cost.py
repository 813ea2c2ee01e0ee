"""The step-cost model behind `itl_slo_ms` (engine/step_cost.py) and the scheduler's use of it: a budget that keeps
a step's predicted time under the target, prompts that always advance, and the fixed budget as the cap."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.step_cost import HEADROOM, MIN_STEPS, StepCost, attention_work, nonnegative_solve


def _fed(c0: float, c1: float, c2: float, c3: float = 0.0, steps: int = 200, noise: float = 0.0) -> StepCost:
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(steps):
        d, p, ctx = rng.randint(0, 32), rng.choice([0, 0, 16, 64, 256, 512]), rng.choice([0, 512, 2048, 3500])
        att = attention_work(p, ctx)
        cost.observe(d, p, att, False, (c0 + c1 * d + c2 * p + c3 * att) * (1 + rng.uniform(-noise, noise)))
    return cost


def test_the_fit_recovers_the_cost_and_the_budget_meets_the_target() -> None:
    cost = _fed(0.010, 0.002, 0.0004, 0.05)
    assert cost.coef[:4] == pytest.approx([0.010, 0.002, 0.0004, 0.05], rel=1e-3) and cost.coef[4] == 0
    for context in (0, 3000):  # a chunk deep in a long prompt costs more, so it is smaller
        budget = cost.prompt_budget(16, context, target_s=0.100, floor=16, cap=2048)
        assert cost.predict(16, budget, attention_work(budget, context)) <= HEADROOM * 0.100
        assert cost.predict(16, budget + 1, attention_work(budget + 1, context)) > HEADROOM * 0.100
    assert cost.prompt_budget(16, 3000, 0.100, 16, 2048) < cost.prompt_budget(16, 0, 0.100, 16, 2048)
    # a step's drafts (speculative decoding) take their predicted time from the prompt tokens' room
    with_drafts = cost.prompt_budget(16, 0, 0.100, 16, 2048, extra_s=0.005)
    assert cost.predict(16, with_drafts, attention_work(with_drafts, 0)) + 0.005 <= HEADROOM * 0.100
    assert cost.predict(16, with_drafts + 1, attention_work(with_drafts + 1, 0)) + 0.005 > HEADROOM * 0.100
    # a prompt chunk priced in decodes, and back: the most tokens whose time is within so many decodes'
    for context in (0, 3000):
        for decodes in (0.5, 1, 7.25, 40):
            n = cost.tokens_for(decodes, context)
            assert cost.decodes_for(n, context) <= decodes + 1e-9 < cost.decodes_for(n + 1, context)


def test_noise_still_gives_a_budget_near_the_truth() -> None:
    truth = int((HEADROOM * 0.100 - 0.010 - 0.002 * 16) / 0.0004)  # no attention term here
    budget = _fed(0.010, 0.002, 0.0004, steps=400, noise=0.2).prompt_budget(16, 0, 0.100, 16, 2048)
    assert 0.8 * truth <= budget <= 1.2 * truth


def test_bounds_and_no_model_yet() -> None:
    cost = StepCost()
    for _ in range(MIN_STEPS - 1):
        cost.observe(4, 64, attention_work(64, 0), False, 0.05)
    assert cost.coef is None and cost.prompt_budget(4, 0, 0.01, 16, 512) == 512  # untrained: the fixed budget
    fast = _fed(0.001, 0.0, 0.00001)
    assert fast.prompt_budget(8, 0, 1.0, 16, 512) == 512  # slack: never past the configured budget
    slow = _fed(0.5, 0.01, 0.01)
    assert slow.prompt_budget(8, 0, 0.1, 16, 512) == 16  # out of reach: prompts still advance a block a step


def test_steps_that_never_vary_a_term_keep_it_at_zero() -> None:
    """Hours of decode-only steps: the prompt terms were never seen, and the fit stays solvable (no singular
    matrix inside a step); the first prompt then gets the fixed budget, and teaches the model its cost."""
    cost = StepCost()
    for _ in range(10_000):
        cost.observe(16, 0, 0.0, False, 0.05)
    assert cost.coef[2] == cost.coef[3] == cost.coef[4] == 0.0 and cost.prompt_budget(16, 0, 0.1, 16, 512) == 512


def _graphed_and_eager(eager_from: int, steps: int = 300) -> tuple[StepCost, object]:
    """A GPU-like engine's steps: a graph replays a step of fewer than `eager_from` prompt tokens (1 ms plus the
    tokens); one with more runs eagerly, 10 ms of launches more. Returns the fitted model and the truth."""
    def truth(d: int, p: int) -> float:
        return 0.001 + 0.00002 * d + 0.00001 * p + 0.010 * (p >= eager_from)
    rng, cost = random.Random(1), StepCost()
    for _ in range(steps):
        d, p = rng.randint(1, 64), rng.choice([0, 0, 16, 64, 256, 512, 1024])
        cost.observe(d, p, 0.0, p >= eager_from, truth(d, p))
    return cost, truth


def test_eager_steps_are_priced_apart_from_graphed_ones() -> None:
    """With CUDA graphs on, a step they do not replay costs its launches on top of its tokens: the fit learns that
    apart, and a budget keeps to a graphed step where an eager one would miss the target."""
    # `full_decode_only`: every step with prompt tokens is eager
    cost, truth = _graphed_and_eager(eager_from=1)
    assert cost.coef == pytest.approx([0.001, 0.00002, 0.00001, 0.0, 0.010], abs=1e-7)
    n = cost.prompt_budget(16, 0, 0.020, floor=16, cap=4096, eager_from=1)
    assert truth(16, n) <= HEADROOM * 0.020 < truth(16, n + 1)
    assert cost.prompt_budget(16, 0, 0.012, floor=16, cap=4096, eager_from=1) == 16  # no eager step fits: the floor
    # `full`: the largest mixed bucket holds 300 tokens, so 16 decodes leave 284 prompt tokens graphed
    cost, truth = _graphed_and_eager(eager_from=285)
    n = cost.prompt_budget(16, 0, 0.020, floor=16, cap=4096, eager_from=285)
    assert n > 284 and truth(16, n) <= HEADROOM * 0.020 < truth(16, n + 1)  # room for an eager step's launches
    assert cost.prompt_budget(16, 0, 0.014, floor=16, cap=4096, eager_from=285) == 284  # not for them: the bucket
    assert cost.prompt_budget(16, 0, 0.014, floor=16, cap=4096) > 284  # (what the fit alone would allow)


def test_the_scheduler_chunks_a_long_prompt_by_the_model(tiny_model_dir) -> None:
    """With the model fed a known cost, a step's prompt tokens are what it allows, and the prompt still completes."""
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_model_len=1024,
                                 max_num_batched_tokens=512, itl_slo_ms=100.0, enable_prefix_caching=False))
    eng.scheduler.step_cost = _fed(0.010, 0.002, 0.0004)
    eng.scheduler.step_cost.observe = lambda *args: None  # keep the known model: real steps here take ~1 ms
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"s{i}", [3 + i] * 8, p)
    for _ in range(3):
        eng.step()  # four streams decoding
    eng.add_request("long", [5 + i % 300 for i in range(800)], SamplingParams(max_tokens=2, ignore_eos=True))
    chunks = []
    while "long" in eng.requests:
        eng.step()
        chunks.append(eng.scheduler.prompt_budget)
    expected = int((HEADROOM * 0.100 - 0.010 - 0.002 * 4) / 0.0004)  # prompt tokens beside 4 decodes
    assert expected in chunks and max(chunks) <= expected
    assert eng.stats()["prompt_budget"] == eng.scheduler.prompt_budget
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("mixed", [False, True], ids=["full_decode_only", "full"])
def test_an_engine_with_graphs_tells_its_eager_steps(tiny_model_dir, mixed) -> None:
    """With graphs (run eagerly on their buffers here: no GPU) the engine tells the model which steps no graph
    replays, and sizes a prompt's chunks by that: under `full_decode_only` every step with prompt tokens, under
    `full` none of these (the largest mixed bucket holds the whole budget)."""
    from tests.engine.test_cuda_graphs import uncaptured

    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_model_len=1024,
                                 max_num_batched_tokens=512, itl_slo_ms=16.0, enable_prefix_caching=False))
    uncaptured(eng, mixed=mixed)
    seen = []
    eng.scheduler.step_cost.observe = lambda d, p, att, eager, s: seen.append((p > 0, eager))
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"s{i}", [3 + i] * 8, p)
    for _ in range(3):
        eng.step()
    eng.add_request("long", [5 + i % 300 for i in range(800)], SamplingParams(max_tokens=2, ignore_eos=True))
    while "long" in eng.requests:
        eng.step()
    assert {False, True} <= {prompt for prompt, _ in seen}
    assert all(eager == (prompt and not mixed) for prompt, eager in seen)

    cost, truth = _graphed_and_eager(eager_from=1)  # a known model: 10 ms of launches for an eager step
    eng.scheduler.step_cost = cost
    cost.observe = lambda *args: None
    eng.add_request("long2", [7 + i % 300 for i in range(800)], SamplingParams(max_tokens=2, ignore_eos=True))
    chunks = []
    while "long2" in eng.requests:
        eng.step()
        chunks.append(eng.scheduler.prompt_budget)
    eager = cost.prompt_budget(4, 0, 0.016, 16, 512, eager_from=1)
    assert eager < 508 and truth(4, eager) <= HEADROOM * 0.016 < truth(4, eager + 1)
    assert max(chunks) == (eager if not mixed else 512 - 4)  # (the configured budget, less the 4 decodes)
    while eng.has_unfinished():
        eng.step()


def test_an_engine_without_a_target_keeps_its_budget(tiny_model_dir) -> None:
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                                 max_num_batched_tokens=64))
    eng.generate([[3] * 100], SamplingParams(max_tokens=2, ignore_eos=True))
    # the last step decoded one token: 63 of the fixed 64 were left for prompts; no model is fitted
    assert eng.scheduler.prompt_budget == 63 and eng.scheduler.step_cost.steps == 0


def test_speculation_feeds_the_model_without_a_target(tiny_model_dir) -> None:
    """Speculative decoding prices drafts by the step-cost model, so the engine fits it with no `itl_slo_ms` too: on
    the steps without drafts; the steps with drafts teach what they add to it, and the draft model's time its own
    model."""
    prompt = [3, 4, 5, 6, 7, 8, 9] * 12  # the greedy output soon repeats: prompt lookup drafts
    for spec in ("ngram", f"draft:{tiny_model_dir}"):
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, speculative=spec))
        eng.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        cost, sp, st = eng.scheduler.step_cost, eng.scheduler.spec, eng.stats()
        assert st["spec_draft_tokens"] > 0 and cost.coef is not None and sp.verify_cost.coef is not None
        assert 0 < cost.steps < st["num_steps"] and sp.verify_cost.steps > 0  # plain steps, and steps with drafts
        assert (sp.draft_cost.coef is not None) == spec.startswith("draft:")


def test_bad_target_is_refused() -> None:
    with pytest.raises(ValueError, match="itl_slo_ms"):
        EngineConfig(itl_slo_ms=0)


def test_the_nonnegative_fit_is_the_best_one_with_no_term_below_zero() -> None:
    """Against every subset of terms held at zero, solved and kept where feasible: the fit's error is the least."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(2, 6))
        x = rng.normal(size=(int(rng.integers(n, 3 * n)), n)) * rng.uniform(0.1, 100, size=n)
        y = x @ rng.normal(size=n) + rng.normal(size=len(x)) * 0.1
        a, b = x.T @ x + np.eye(n) * 1e-9, x.T @ y
        got = nonnegative_solve(a, b)
        assert (got >= 0).all()
        best = np.inf
        for mask in itertools.product([False, True], repeat=n):
            idx = np.flatnonzero(mask)
            c = np.zeros(n)
            if len(idx):
                c[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if (c >= 0).all():
                best = min(best, float(np.sum((x @ c - y) ** 2)))
        assert np.sum((x @ got - y) ** 2) <= best * (1 + 1e-6) + 1e-9


def test_terms_that_move_together_do_not_spoil_the_fit() -> None:
    """Steps whose prompt chunks grew with their decodes, and whose time the fit can only match with a prompt token
    costing less than nothing. Zeroing that term alone (the fit before) kept the decodes' cost fitted beside it, and
    its predictions of the very steps it saw were 32% off; fitted again without it, 0.5%."""
    cost = StepCost()
    steps = []
    for i in range(40):
        d, p = 4 * i, 2 * i + i % 3
        seconds = 0.020 + 0.002 * d - 0.001 * p
        cost.observe(d, p, 0.0, False, seconds)
        steps.append((d, p, seconds))
    assert (cost.coef >= 0).all() and cost.coef[2] == 0
    worst = max(abs(cost.predict(d, p, 0.0) - s) / s for d, p, s in steps[-10:])
    assert worst < 0.02, worst
