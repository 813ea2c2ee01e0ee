"""Speculative decoding by prompt lookup (engine/spec.py): proposals, greedy output identical with it on and off
under every policy (with prefix hits, chunking and preemption), stops inside a verified draft, sampled output's
distribution unchanged, back-off, KV rollback."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import Request
from engine.spec import PROBE_EVERY, Speculation, _lookup, _Tokens, expected_kept, propose


def test_propose_takes_the_latest_occurrence_of_the_longest_suffix():
    assert propose([1, 2, 3, 9, 9, 1, 2, 3], 3, 1, 4) == [9, 9, 1]
    # the 3-token suffix [7, 1, 2] occurred once; its continuation wins over the later [1, 2] match
    assert propose([7, 1, 2, 5, 1, 2, 6, 7, 1, 2], 2, 2, 3) == [5, 1]
    assert propose([1, 2, 8, 1, 2, 9, 1, 2], 1, 2, 2) == [9]  # latest
    assert propose([1, 2, 3, 4], 4, 1, 3) == []  # nothing recurs
    assert propose([5, 5], 4, 1, 1) == [5]  # the continuation runs up to the end, no further
    assert propose([1, 2, 1, 2], 0, 1, 2) == []
    assert propose([3, 1, 2, 4, 1, 2], 8, 2, 2) == [4, 1, 2]


def test_propose_matches_a_brute_force_search():
    """Against the definition, on random token runs over small alphabets (many repeats), and through the grown
    array a request keeps (`_Tokens`) as its tokens arrive one or a few at a time."""
    def brute(toks, k, nmin, nmax):
        for n in range(min(nmax, len(toks) - 1), nmin - 1, -1):
            suffix = toks[len(toks) - n:]
            starts = [s for s in range(len(toks) - n) if toks[s:s + n] == suffix]
            if starts:
                return toks[starts[-1] + n: starts[-1] + n + k]
        return []

    rng = random.Random(0)
    for trial in range(300):
        alphabet, nmin = rng.choice([2, 3, 5, 50]), rng.randint(1, 3)
        nmax, k = rng.randint(nmin, 5), rng.randint(1, 6)
        toks, grown = [], _Tokens()
        for _ in range(rng.randint(1, 120)):
            toks += [rng.randrange(alphabet) for _ in range(rng.choice([1, 1, 1, 3]))]
            want = brute(toks, k, nmin, nmax) if len(toks) > nmin else []
            assert propose(toks, k, nmin, nmax) == want, (toks, k, nmin, nmax)
            assert _lookup(grown.of(toks), k, nmin, nmax) == want


def _req(ids, **params) -> Request:
    return Request("r", ids, SamplingParams(**params), max_tokens=params.get("max_tokens") or 100)


def test_drafts_fit_max_tokens_and_context_and_skip_penalties():
    cfg = EngineConfig(speculative="ngram", num_speculative_tokens=4)
    spec = Speculation(cfg, max_model_len=1000)
    ids = [1, 2, 3, 4, 5, 6, 1, 2]
    assert spec.draft(_req(ids, max_tokens=100)) == [3, 4, 5, 6]
    assert spec.draft(_req(ids, max_tokens=3)) == [3, 4]  # three more tokens at most: two drafts and one drawn
    assert Speculation(cfg, max_model_len=10).draft(_req(ids)) == [3]
    assert spec.draft(_req(ids, presence_penalty=0.5)) == []
    assert spec.draft(_req(ids, logit_bias={3: -1.0})) == []  # (verification takes the unbiased argmax)
    assert spec.draft(_req(ids, allowed_token_ids=[3])) == []
    held = _req(ids[:6], min_tokens=2, stop_token_ids=[9])
    held.min_tokens_banned = [9]  # (as the engine sets it): a draft position's ban would depend on the drafts before it
    held.token_ids += [1]  # one token out
    assert spec.draft(held) == []
    held.token_ids += [2]  # two: no more ban
    assert spec.draft(held) == [3, 4, 5, 6]


def test_back_off_after_misses_and_growth_after_hits():
    spec = Speculation(EngineConfig(speculative="ngram", num_speculative_tokens=4), max_model_len=1000)
    r = _req([1, 2, 3, 4, 5, 6, 1, 2])
    spec.observe(r, 4, 1)
    assert r.spec_k == 2
    spec.observe(r, 2, 2)
    assert r.spec_k == 3
    spec.observe(r, 3, 0)
    assert (r.spec_k, r.spec_cooldown) == (1, 0)
    spec.observe(r, 1, 0)
    assert r.spec_cooldown == 2
    assert spec.draft(r) == [] and spec.draft(r) == [] and spec.draft(r) == [3]  # two steps off, then one token
    spec.observe(r, 1, 0)
    assert r.spec_cooldown == 4  # doubles
    assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (11, 3)


def _teach(spec: Speculation, c0: float, c1: float, c4: float) -> Speculation:
    """`spec` after plain steps that took c0 + c1 * decodes seconds, and steps whose drafts added c4 a token."""
    rng = random.Random(0)
    for _ in range(100):
        d = rng.randint(1, 64)
        spec.step_cost.observe(d, 0, 0.0, False, c0 + c1 * d)
    for _ in range(20):
        d, k, m = rng.randint(1, 64), rng.choice([4, 16, 64]), rng.randint(1, 4)
        spec.observe_step(spec.step_cost.predict(d, 0, 0.0), c0 + c1 * d + c4 * k, k, m)
    return spec


def _accepting(spec: Speculation, alpha: float, n: int = 400) -> None:
    """`n` verifications of 4 draft tokens, each kept with chance `alpha` until the first rejection."""
    rng, r = random.Random(1), _req([1, 2])
    for _ in range(n):
        kept = 0
        while kept < 4 and rng.random() < alpha:
            kept += 1
        spec.observe(r, 4, kept)


def test_acceptance_rate_and_expected_tokens():
    assert expected_kept(0.5, 4) == pytest.approx(0.9375) and expected_kept(1.0, 3) == 3 and expected_kept(0.0, 4) == 0
    for alpha in (0.2, 0.7, 0.95):
        spec = Speculation(EngineConfig(speculative="ngram"), 1000)
        assert spec.acceptance == 0.5  # the prior
        _accepting(spec, alpha)
        assert spec.acceptance == pytest.approx(alpha, abs=0.05)


def test_drafts_only_where_they_pay():
    """The gate: by the step-time model (a CPU's shape: 2 ms a step, 0.05 ms a decode, 0.5 ms a draft token) and the
    acceptance rate, the draft length that yields the most tokens per second, none where plain decoding yields more;
    after PROBE_EVERY declined steps one request's draft goes through."""
    spec = _teach(Speculation(EngineConfig(speculative="ngram", num_speculative_tokens=4), 1000), 0.002, 0.00005, 0.0005)
    _accepting(spec, 0.7)
    # batch 1: k tokens cost 2.05 + 0.5 k ms and yield 1 + 0.7 + ... + 0.7^k; k = 2 is best (0.718 tokens a ms)
    assert spec.allow(1, [4]) == [2] and spec.allow(1, [1]) == [1]
    assert spec.allow(64, [4] * 64) == [0] * 64  # a full batch: each draft token costs ten decodes
    assert spec.num_declined == 1
    assert [sum(spec.allow(64, [4] * 64)) for _ in range(PROBE_EVERY)] == [0] * (PROBE_EVERY - 1) + [4]
    assert spec.allow(64, [3, 4, 2]) == [0, 0, 0]  # after a probe (one request's draft, all of it), declined again
    # before anyone proposes (lookups cost time too): a batch where even the best case does not pay proposes nothing
    assert spec.may_pay(1) and not spec.may_pay(64)
    for _ in range(PROBE_EVERY - 2):
        assert not spec.may_pay(64)
    assert spec.may_pay(64) and spec.may_pay(64)  # a probe is due, and stays due until a draft goes through
    assert spec.allow(64, [2, 4]) == [2, 0]
    assert not spec.may_pay(64)
    low = _teach(Speculation(EngineConfig(speculative="ngram"), 1000), 0.002, 0.00005, 0.0005)
    _accepting(low, 0.1)
    assert low.allow(1, [4]) == [0]  # rarely kept: not worth even one token
    assert Speculation(EngineConfig(speculative="ngram"), 1000).allow(1, [3, 2]) == [3, 2]  # no model yet: all
    off = _teach(Speculation(EngineConfig(speculative="ngram", speculative_adaptive=False), 1000), 0.002, 0.00005, 0.0005)
    _accepting(off, 0.1)
    assert off.allow(64, [4] * 64) == [4] * 64


@pytest.mark.parametrize("mixed", [True, False], ids=["full", "full_decode_only"])
def test_a_draft_that_leaves_every_graph_pays_for_the_eager_step(mixed):
    """With CUDA graphs (a GPU's shape: a replayed step 1 ms, an eager one 10 ms more, 0.1 ms a draft token), a
    batch-1 draft pays where a mixed graph replays its step, and not where drafts make the step eager (decode
    graphs only: a step with drafts has more tokens than sequences)."""
    from engine.cuda_graphs import StepGraphs, buckets, capture_sizes, token_sizes

    g = StepGraphs.__new__(StepGraphs)
    g.decode, g.mixed = buckets(capture_sizes(64), token_sizes(512) if mixed else [], 64, 1024)
    g.max_num_seqs = 64
    spec = Speculation(EngineConfig(speculative="ngram", num_speculative_tokens=4), 1000)
    rng = random.Random(0)
    for _ in range(100):  # plain steps, replayed or (with prompt tokens, decode graphs only) eager
        d, p = rng.randint(1, 64), rng.choice([0, 0, 16, 64, 256])
        eager = p >= g.eager_from(d)
        spec.step_cost.observe(d, p, 0.0, eager, 0.001 + 0.00001 * d + 0.000001 * p + 0.010 * eager)
    for _ in range(20):  # what drafts add beside that
        d, k, m = rng.randint(1, 16), rng.choice([4, 16]), rng.randint(1, 4)
        spec.observe_step(spec.step_cost.predict(d, 0, 0.0, g.eager_from(d, k) == 0),
                          0.001 + 0.00001 * d + 0.0001 * k + 0.010 * (g.eager_from(d, k) == 0), k, m)
    _accepting(spec, 0.7)
    if not mixed:
        assert spec.step_cost.coef[4] == pytest.approx(0.010, rel=1e-3)
    assert spec.allow(1, [4], graphs=g) == ([4] if mixed else [0])
    assert spec.allow(1, [4]) == [4]  # (priced without graphs: no eager step)


def test_a_draft_model_pays_for_its_forwards():
    """With a draft model each further draft token costs a forward of it (here 1 ms), and its catch-up tokens
    (0.01 ms each) come first."""
    spec = _teach(Speculation(EngineConfig(speculative="draft:/models/small"), 1000), 0.002, 0.00005, 0.00015)
    _accepting(spec, 0.9)
    assert spec.allow(1, [4], catchup=1) == [4]  # its cost unknown yet: all of it
    for f, t in [(1, 200), (4, 3), (2, 40)]:  # three steps tell its two terms apart
        spec.observe_step(None, 0.0, 4, 1, forwards=f, tokens=t, draft_s=0.001 * f + 0.00001 * t)
    assert spec.seconds([4], catchup=1) == pytest.approx(4 * 0.00015 + 0.004 + 0.00001 * 4)
    # k = 3: 3.44 tokens in 5.53 ms (k = 4: 4.1 in 6.69), against 1 in 2.05
    assert spec.allow(1, [4], catchup=1) == [3]
    assert spec.allow(1, [4], catchup=2000) == [0]  # the catch-up alone costs 20 ms
    low = _teach(Speculation(EngineConfig(speculative="draft:/models/small"), 1000), 0.002, 0.00005, 0.00015)
    low.draft_cost = spec.draft_cost
    _accepting(low, 0.3)
    assert low.allow(1, [4], catchup=1) == [0]


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1024) for _ in range(40)]
    loop = [rng.randrange(3, 1024) for _ in range(7)]
    return [
        loop * 12,  # copy-heavy: the pattern goes on
        shared + loop * 3 + [11, 12],
        shared + [rng.randrange(3, 1024) for _ in range(30)],  # shares a prefix with the one before
        [rng.randrange(3, 1024) for _ in range(90)],
        [5, 6],
    ]


SETUPS = {
    "mixed": dict(scheduling="mixed"),
    "prefill_first": dict(scheduling="prefill_first"),
    "static": dict(scheduling="static", max_num_seqs=3),
    "mixed-chunked": dict(scheduling="mixed", max_num_batched_tokens=40, long_prefill_token_threshold=24,
                          max_num_partial_prefills=2),
    "mixed-preempting": dict(scheduling="mixed", num_kv_blocks=24, block_size=8),
    "mixed-no-prefix-cache": dict(scheduling="mixed", enable_prefix_caching=False, block_size=8),
}
MAX_TOKENS = [300, 41, 177, 256, 223]


def _run(model_dir, setup: dict, prompts, params, **spec):
    # NOTE: without the cost model's gate (timed, so not deterministic): every proposal is verified
    cfg = dict(num_kv_blocks=256, speculative_disable_by_batch_size=64, speculative_adaptive=False) | setup | spec
    eng = LLMEngine(EngineConfig(model=str(model_dir), **cfg))
    outs = []
    for _ in range(2):  # the second round meets the first's prompts in the prefix cache
        eng.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0))  # warms the cache for round two
        outs.append(eng.generate(prompts, params))
        eng.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return outs, eng.stats()


CASES = [("ngram", s) for s in SETUPS] + [("draft", s) for s in ("mixed", "static", "mixed-chunked", "mixed-preempting")]


@pytest.mark.parametrize("method,setup", CASES)
def test_greedy_output_identical_with_and_without_speculation(tiny_model_dir, draft_dir, method, setup):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in MAX_TOKENS]
    base, base_stats = _run(tiny_model_dir, SETUPS[setup], prompts, params)
    spec, stats = _run(tiny_model_dir, SETUPS[setup], prompts, params,
                       speculative="ngram" if method == "ngram" else f"draft:{draft_dir}")
    for round_base, round_spec in zip(base, spec):
        for a, b in zip(round_base, round_spec):
            assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
            assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], "accepted and rejected drafts both"
    assert stats["num_steps"] < base_stats["num_steps"]
    if setup == "mixed-preempting":
        assert stats["num_preemptions"] > 0 and base_stats["num_preemptions"] > 0
    if setup != "mixed-no-prefix-cache":
        assert stats["prefix_cache_hits"] > 0


def test_stop_inside_a_verified_draft(tiny_model_dir):
    """A stop token, a stop string and max_tokens that fall inside a run of accepted draft tokens end the request
    exactly where plain decoding does."""
    prompt = _prompts()[0]
    base_eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128))
    ref = base_eng.generate([prompt], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))[0]
    stop_id = ref.token_ids[150]
    stop_text = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]
    cases = [SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
             SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, stop=[stop_text]),
             SamplingParams(max_tokens=203, temperature=0.0, ignore_eos=True),
             # with min_tokens: the stop token held back (no drafts meanwhile), and a stop string ignored, in drafts too
             SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=160),
             SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, stop=[stop_text], min_tokens=200)]
    spec_eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, speculative="ngram",
                                      speculative_adaptive=False))
    for p in cases:
        a = base_eng.generate([prompt], p)[0]
        b = spec_eng.generate([prompt], p)[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert spec_eng.stats()["spec_accepted_tokens"] > 0
    spec_eng.check_integrity()


def test_rejected_drafts_give_their_blocks_back(tiny_model_dir):
    """After every step a request holds the blocks its tokens need, no more (the rest held only rejected drafts)."""
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, block_size=4, speculative="ngram",
                                 num_speculative_tokens=8, speculative_adaptive=False))
    eng.add_request("a", _prompts()[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    req, rejected = eng.requests["a"], 0
    while eng.has_unfinished():
        before = eng.stats()
        eng.step()
        after = eng.stats()
        rejected += (after["spec_draft_tokens"] - before["spec_draft_tokens"]) - (
            after["spec_accepted_tokens"] - before["spec_accepted_tokens"])
        if req.status.value == "running":
            bm = eng.block_manager  # the last token's block may come with the next step's allocation
            assert bm.blocks_needed(req.num_computed_tokens) <= len(req.block_table) <= bm.blocks_needed(req.num_tokens)
            assert req.num_computed_tokens == req.num_tokens - 1
        eng.check_integrity()
    assert rejected > 0 and eng.stats()["spec_accepted_tokens"] > 0


def test_no_drafts_at_or_above_the_disable_batch_size(tiny_model_dir):
    prompts = _prompts()[:3]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, speculative="ngram",
                                 speculative_disable_by_batch_size=3))
    eng.generate(prompts, params)
    assert eng.stats()["spec_draft_tokens"] == 0
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, speculative="ngram",
                                 speculative_disable_by_batch_size=4, speculative_adaptive=False))
    eng.generate(prompts, params)
    assert eng.stats()["spec_draft_tokens"] > 0


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity over the categories of a and b; returns the p-value."""
    cats = sorted(set(a) | set(b), key=str)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for c in cats:
        total = a[c] + b[c]
        for n, obs in ((na, a[c]), (nb, b[c])):
            exp = total * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                          torch.tensor(stat / 2, dtype=torch.float64))) if df else 1.0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_distribution_unchanged(tiny_model_dir, method):
    """Sampling (temperature 0.8, top-k 3) with and without speculation: the joint distribution of the first three
    output tokens is the same, by a chi-square test of homogeneity at alpha = 1e-3 (a correct sampler fails it once
    in a thousand choices of the engines' seeds; these are fixed, so the test is deterministic). Both the rule's
    branches run: some drafts are accepted, some rejected."""
    # the prompt leads into the model's own greedy loop, so drafts (the loop's next tokens) are often likely
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128))
    start = _prompts()[0]
    prompt = start + eng.generate([start], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0].token_ids
    n = 800
    results = []
    spec_of = {"ngram": "ngram", "draft": f"draft:{tiny_model_dir}"}  # the model as its own draft: kept when likely
    for spec in (None, spec_of[method]):
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=2048, max_num_seqs=n,
                                     max_num_batched_tokens=n * 5 + 128, speculative=spec, seed=1 + (spec is None),
                                     speculative_disable_by_batch_size=n + 1, max_model_len=512,
                                     speculative_adaptive=False))
        params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=3, ignore_eos=True) for _ in range(n)]
        eng.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's KV, then found in the prefix cache
        outs = eng.generate([prompt] * n, params)
        results.append(Counter(tuple(o.token_ids) for o in outs))
        if spec:
            st = eng.stats()
            assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    # categories too rare for the test's approximation are pooled
    common = {c for c in results[0] | results[1] if results[0][c] + results[1][c] >= 20}
    pooled = [Counter({(c if c in common else "rare"): k for c, k in r.items()}) for r in results]
    p = _chi_square_p(*pooled)
    assert p > 1e-3, (p, pooled)
    assert len(common) >= 3  # the test has something to compare
    assert not math.isnan(p)


def test_seeded_sampling_never_drafts(tiny_model_dir):
    """A seeded request's text depends on its seed alone: whether it would draft depends on the load, and
    verification draws other uniforms than plain sampling, so it does not draft."""
    prompt = _prompts()[0]
    params = SamplingParams(max_tokens=60, temperature=0.8, top_k=3, ignore_eos=True, seed=5)
    base = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128)).generate([prompt], params)[0]
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, speculative="ngram"))
    assert eng.generate([prompt], params)[0].token_ids == base.token_ids
    assert eng.stats()["spec_draft_tokens"] == 0



def test_draft_model_as_its_own_draft_keeps_every_token(tiny_model_dir):
    """The model drafting for itself: every greedy draft token is kept, including the last one, whose KV the draft
    model computes only at the next step; the output is plain decoding's."""
    prompt = _prompts()[3]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    base = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)).generate([prompt], params)[0]
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, speculative=f"draft:{tiny_model_dir}",
                                 num_speculative_tokens=4, speculative_adaptive=False))
    assert eng.generate([prompt], params)[0].token_ids == base.token_ids
    st = eng.stats()
    assert st["spec_accepted_tokens"] == st["spec_draft_tokens"] > 0
    assert st["num_steps"] <= 1 + -(-120 // 5) + 1  # the prompt, then five tokens a step
    assert st["kv_cache_bytes"] == 2 * LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)).stats()["kv_cache_bytes"]


def test_draft_model_must_share_the_vocabulary(tiny_model_dir, tmp_path):
    from engine.tiny import build

    other = build("tiny", tmp_path / "other", seed=9, progress=False)
    with pytest.raises(ValueError, match="another vocabulary"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), speculative=f"draft:{other}"))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_gate_in_the_engine(tiny_model_dir, method):
    """The engine with the gate on (the default) and a known step cost: where drafts are cheap it drafts; where a
    draft token costs 100 steps it drafts only on probes, once every PROBE_EVERY + 1 steps; either way the greedy
    output is plain decoding's."""
    prompt = _prompts()[0]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    base = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128)).generate([prompt], params)[0]
    spec = "ngram" if method == "ngram" else f"draft:{tiny_model_dir}"
    for c4, drafting in ((1e-5, "often"), (0.2, "probes")):
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, speculative=spec))
        sp = _teach(eng.scheduler.spec, 0.002, 0.0001, c4)
        for f, t in [(1, 200), (4, 3), (2, 40), (3, 2)]:  # a draft forward costs 0.1 ms
            sp.observe_step(None, 0.0, 4, 1, forwards=f, tokens=t, draft_s=0.0001 * f + 1e-7 * t)
        eng.scheduler.step_cost.observe = sp.observe_step = lambda *args, **kw: None  # keep the known models
        assert eng.generate([prompt], params)[0].token_ids == base.token_ids
        spec_obj = eng.scheduler.spec
        if drafting == "often":
            assert spec_obj.num_steps > 20 and spec_obj.num_declined < spec_obj.num_steps
        else:
            assert 0 < spec_obj.num_steps <= eng.stats()["num_steps"] // (PROBE_EVERY + 1) + 1
            assert eng.stats()["spec_declined_steps"] == spec_obj.num_declined >= PROBE_EVERY
