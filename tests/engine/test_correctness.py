"""Greedy tokens of the engine equal a plain greedy loop over transformers' own model, on the same
weights, for Llama (GQA, tied; untied + llama3 rope), Qwen2 (q/k/v bias) and Qwen3 (q/k norm) —
under every policy, chunked, served from the prefix cache, and under preemption."""
from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tiny import hf_shape_configs, write_hf_shape

NEW_TOKENS = 20


@pytest.fixture(scope="module", params=list(hf_shape_configs()))
def hf_model(request, tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp(request.param)
    return request.param, write_hf_shape(hf_shape_configs()[request.param], out, tiny_model_dir), out


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 1024) for _ in range(200)]
    lens = [1, 2, 17, 64, 100, 150, 233, 300]
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in lens]
    prompts += [shared + [rng.randrange(3, 1024) for _ in range(n)] for n in (5, 40, 100)]  # long shared prefix
    return prompts


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW_TOKENS):  # no KV cache: the plainest possible reference
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def reference(hf_model):
    name, model, path = hf_model
    return [_hf_greedy(model, p) for p in _prompts()]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

SETUPS = {
    "mixed": dict(scheduling="mixed"),
    "prefill_first": dict(scheduling="prefill_first"),
    "static": dict(scheduling="static", max_num_seqs=4),
    "mixed-chunked": dict(scheduling="mixed", max_num_batched_tokens=48, long_prefill_token_threshold=32,
                          max_num_partial_prefills=2),
    "mixed-no-prefix-cache": dict(scheduling="mixed", enable_prefix_caching=False, block_size=8),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_matches_transformers(hf_model, reference, setup):
    _, _, path = hf_model
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, **SETUPS[setup]))
    outs = eng.generate(_prompts(), GREEDY)
    for i, (o, ref) in enumerate(zip(outs, reference)):
        assert o.token_ids == ref, f"prompt {i} (len {len(_prompts()[i])}) diverged under {setup}"
        assert o.finish_reason == "length"
    if setup == "mixed-chunked":
        assert eng.stats()["num_steps"] > NEW_TOKENS + 20, "long prompts should have been chunked"
    eng.check_integrity()
    assert eng.stats()["num_free_kv_blocks"] == eng.stats()["num_kv_blocks"]


def test_prefix_cache_second_run_same_tokens(hf_model, reference):
    _, _, path = hf_model
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, block_size=16))
    first = eng.generate(_prompts(), GREEDY)
    computed_first = eng.stats()["prompt_tokens_computed"]
    second = eng.generate(_prompts(), GREEDY)
    computed_second = eng.stats()["prompt_tokens_computed"] - computed_first
    for a, b, ref in zip(first, second, reference):
        assert a.token_ids == b.token_ids == ref
    assert all(o.num_cached_tokens > 0 for o, p in zip(second, _prompts()) if len(p) > 16)
    assert computed_second < computed_first / 4
    # the shared-prefix prompts hit each other's blocks even in the first run
    assert any(o.num_cached_tokens >= 192 for o in first[-3:][1:])
    eng.check_integrity()


def test_preemption_same_tokens(hf_model, reference):
    _, _, path = hf_model
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=24, block_size=16,
                                 max_model_len=384, max_num_batched_tokens=64, long_prefill_token_threshold=64))
    outs = eng.generate(_prompts(), GREEDY)
    assert eng.stats()["num_preemptions"] > 0
    for o, ref in zip(outs, reference):
        assert o.token_ids == ref
    eng.check_integrity()
    assert eng.stats()["num_free_kv_blocks"] == eng.stats()["num_kv_blocks"]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "async-scheduling"])
def test_tokens_under_fairness_preemptions_equal_transformers(hf_model, reference, overlap):
    """Each prompt is its own client and two seats are shared: every late client's request preempts an earlier
    one's (recomputed from its prompt and output so far); the greedy tokens are transformers' all the same, with
    step N+1 scheduled while step N runs too."""
    _, _, path = hf_model
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_num_seqs=2, max_model_len=384,
                                 max_num_batched_tokens=64, long_prefill_token_threshold=64,
                                 async_scheduling=overlap))
    prompts, tokens = _prompts(), {}
    eng.add_request("p0", prompts[0], GREEDY, client="c0")
    eng.add_request("p1", prompts[1], GREEDY, client="c0")
    for out in eng.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, p in enumerate(prompts[2:], 2):
        eng.add_request(f"p{i}", p, GREEDY, client=f"c{i}")
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert eng.stats()["fair_preemptions"] > 0
    for i, ref in enumerate(reference):
        assert tokens[f"p{i}"] == ref, f"prompt {i}"
    eng.check_integrity()


def test_tensor_parallel_matches_transformers(hf_model, reference):
    """The same tokens with the model sharded over two ranks (gloo; for the one-KV-head shape, that head replicated
    on both): chunked prefill with preemption in a small pool, then every prompt again from the prefix cache."""
    _, _, path = hf_model
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=24, block_size=16,
                                 max_model_len=384, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                                 tensor_parallel_size=2))
    try:
        outs = eng.generate(_prompts(), GREEDY)
        assert eng.stats()["num_preemptions"] > 0
        again = eng.generate(_prompts(), GREEDY)
        for i, (o, a, ref) in enumerate(zip(outs, again, reference)):
            assert o.token_ids == a.token_ids == ref, f"prompt {i} diverged under tensor parallelism"
        assert any(a.num_cached_tokens > 0 for a in again)
        eng.check_integrity()
    finally:
        eng.close()
