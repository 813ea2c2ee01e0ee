"""Speculative decoding by prompt lookup (engine/spec.py): proposals, greedy output identical with it on and off
under every policy (with prefix hits, chunking and preemption), stops inside a verified draft, sampled output's
distribution unchanged, back-off, KV rollback."""
from __future__ import annotations

import math
import random
from collections import Counter

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import Request
from engine.spec import Speculation, propose


def test_propose_takes_the_latest_occurrence_of_the_longest_suffix():
    assert propose([1, 2, 3, 9, 9, 1, 2, 3], 3, 1, 4) == [9, 9, 1]
    # the 3-token suffix [7, 1, 2] occurred once; its continuation wins over the later [1, 2] match
    assert propose([7, 1, 2, 5, 1, 2, 6, 7, 1, 2], 2, 2, 3) == [5, 1]
    assert propose([1, 2, 8, 1, 2, 9, 1, 2], 1, 2, 2) == [9]  # latest
    assert propose([1, 2, 3, 4], 4, 1, 3) == []  # nothing recurs
    assert propose([5, 5], 4, 1, 1) == [5]  # the continuation runs up to the end, no further
    assert propose([1, 2, 1, 2], 0, 1, 2) == []
    assert propose([3, 1, 2, 4, 1, 2], 8, 2, 2) == [4, 1, 2]


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
    cfg = dict(num_kv_blocks=256, speculative_disable_by_batch_size=64) | setup | spec
    eng = LLMEngine(EngineConfig(model=str(model_dir), **cfg))
    outs = []
    for _ in range(2):  # the second round meets the first's prompts in the prefix cache
        eng.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0))  # warms the cache for round two
        outs.append(eng.generate(prompts, params))
        eng.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return outs, eng.stats()


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    """A draft model that agrees with the tiny model often, not always: its weights, one layer's MLP perturbed."""
    out = tmp_path_factory.mktemp("draft") / "draft"
    shutil.copytree(tiny_model_dir, out)
    w = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    name = "model.layers.3.mlp.down_proj.weight"
    w[name] = w[name] + torch.randn(w[name].shape, generator=g) * w[name].std() * 0.8
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


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
             SamplingParams(max_tokens=203, temperature=0.0, ignore_eos=True)]
    spec_eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, speculative="ngram"))
    for p in cases:
        a = base_eng.generate([prompt], p)[0]
        b = spec_eng.generate([prompt], p)[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert spec_eng.stats()["spec_accepted_tokens"] > 0
    spec_eng.check_integrity()


def test_rejected_drafts_give_their_blocks_back(tiny_model_dir):
    """After every step a request holds the blocks its tokens need, no more (the rest held only rejected drafts)."""
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, block_size=4, speculative="ngram",
                                 num_speculative_tokens=8))
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
                                 speculative_disable_by_batch_size=4))
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
                                     speculative_disable_by_batch_size=n + 1, max_model_len=512))
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
                                 num_speculative_tokens=4))
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
