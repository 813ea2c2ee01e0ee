"""An engine over a quantized KV cache (`kv_cache_dtype` int8 / fp8, docs/architecture.md §5): it holds more tokens in
the same bytes, its greedy tokens stay those of the model's dtype on most prompts, and every path a block takes
(prefix hits, preemption, the host tier) carries its scales with it: the outputs equal those of the same engine
without that path."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[3 + (i * 7 + 11 * p) % 500 for i in range(20 + 9 * p)] for p in range(8)]
# The most a token's logprob may move when the cache is stored in this dtype (the tiny model, fp32 weights). Measured
# on it: 0.009 (bf16), 0.04 (int8), 0.18 (fp8); the bounds leave room for another CPU's rounding.
LOGPROB_ERROR = {"bfloat16": 0.05, "int8": 0.15, "fp8": 0.5}


def _engine(tiny_model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(tiny_model_dir), "dtype": "float32", "num_kv_blocks": 64,
                                     "max_model_len": 256, **kw}))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return _engine(tiny_model_dir).generate(PROMPTS, dataclasses.replace(GREEDY, logprobs=2))


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8", "fp8"])
def test_greedy_tokens_differ_only_at_near_ties(tiny_model_dir, reference, kv_cache_dtype):
    """While a sequence's tokens agree with the model dtype's, each token's logprob is within the bound; where they
    first differ, the reference's top two were closer than twice the bound (a near-tie flipped). This random model
    has many near-ties (margins down to 0.001), so some sequences do go their own way."""
    eng = _engine(tiny_model_dir, kv_cache_dtype=kv_cache_dtype)
    got = eng.generate(PROMPTS, dataclasses.replace(GREEDY, logprobs=2))
    bound, agreed = LOGPROB_ERROR[kv_cache_dtype], 0
    for g, r in zip(got, reference):
        for a, b, lg, lr in zip(g.token_ids, r.token_ids, g.logprobs, r.logprobs):
            if a != b:
                assert lr.top[0][1] - lr.top[1][1] < 2 * bound, (kv_cache_dtype, lr.top)
                break
            assert abs(lg.logprob - lr.logprob) < bound, (kv_cache_dtype, lg.logprob, lr.logprob)
            agreed += 1
    assert agreed >= len(PROMPTS) * 4  # not vacuous
    eng.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_prefix_hits_preemption_and_the_host_tier_carry_the_scales(tiny_model_dir, kv_cache_dtype):
    """A quantized engine's own outputs are the reference: with prefix caching hit on every prompt's second run, with
    a pool so small that requests are preempted and recomputed, and with blocks moved through the host tier."""
    base = _engine(tiny_model_dir, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    want = [o.token_ids for o in base.generate(PROMPTS, GREEDY)]

    cached = _engine(tiny_model_dir, kv_cache_dtype=kv_cache_dtype)
    cached.generate(PROMPTS, GREEDY)
    again = cached.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == want and all(o.num_cached_tokens > 0 for o in again)

    small = _engine(tiny_model_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=20, max_model_len=160,
                    enable_prefix_caching=False)
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == want
    assert small.stats()["num_preemptions"] > 0

    tiered = _engine(tiny_model_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=24, max_model_len=160,
                     kv_offload_gb=0.01)
    for p in PROMPTS:  # one at a time: each evicts the last ones' cached blocks to the host tier
        tiered.generate([p], GREEDY)
    back = [o for p in PROMPTS for o in tiered.generate([p], GREEDY)]
    stats = tiered.stats()
    assert stats["host_cache_hits"] > 0 and [o.token_ids for o in back] == want
    assert tiered.runner.host_caches[0][2].dtype == torch.float32 and tiered.runner.host_caches[0][2].any()
    tiered.check_integrity()
