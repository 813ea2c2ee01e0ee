"""vLLM's prompt_logprobs: every prompt token's logprob under the model given the tokens before it (the first has
none), its rank and the top alternatives, equal to transformers' on the same weights, whatever the chunking, beside
decoding requests, with a prefix cache that holds the prompt (computed again: a cached block has no logits), and
under async outputs and async scheduling."""
from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, InvalidSamplingParam, LLMEngine, SamplingParams
from engine.tiny import hf_shape_configs, write_hf_shape

K = 3


@pytest.fixture(scope="module")
def hf(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("prompt-logprobs")
    return write_hf_shape(hf_shape_configs()["qwen2-bias"], out, tiny_model_dir), out


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in (1, 2, 40, 300, 700)]


@torch.inference_mode()
def _reference(model, prompt: list[int]) -> list[tuple[float, int, list[int]] | None]:
    lp = model(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    out: list = [None]
    for p in range(1, len(prompt)):
        row, t = lp[p - 1], prompt[p]
        out.append((float(row[t]), int((row > row[t]).sum()) + 1, row.topk(K).indices.tolist()))
    return out


LOOPS = {
    "plain": {},
    "chunked": dict(max_num_batched_tokens=64, long_prefill_token_threshold=32),
    "async_output_proc": dict(async_output_proc=True, max_num_batched_tokens=64),
    "async_scheduling": dict(async_scheduling=True, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_prompt_logprobs_equal_transformers(hf, loop):
    model, path = hf
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=512, block_size=16, **LOOPS[loop]))
    prompts = _prompts()
    # the prompts in the prefix cache first, and a request that decodes beside the scored ones
    eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    computed = eng.stats()["prompt_tokens_computed"]
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=K)] * len(prompts)
    outs = eng.generate([*prompts, prompts[3][:50]], [*params, SamplingParams(max_tokens=60, temperature=0.0)])
    for prompt, o in zip(prompts, outs):
        got, ref = o.prompt_logprobs, _reference(model, prompt)
        assert len(got) == len(prompt) and got[0] is None
        for p, (g, r) in enumerate(zip(got[1:], ref[1:]), start=1):
            assert g.token_id == prompt[p] and g.logprob == pytest.approx(r[0], abs=1e-4), (loop, len(prompt), p)
            assert g.rank == r[1] and [t for t, _ in g.top] == r[2] and len(g.top) == K
        assert o.token_ids == eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
    assert outs[-1].prompt_logprobs is None
    # every scored prompt computed whole again, though the cache held it
    assert eng.stats()["prompt_tokens_computed"] - computed >= sum(map(len, prompts))
    eng.check_integrity()


def test_prompt_logprobs_zero_and_out_of_range(hf):
    model, path = hf
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=128))
    (o,) = eng.generate([_prompts()[2]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert all(lp.top == [] for lp in o.prompt_logprobs[1:])
    with pytest.raises(InvalidSamplingParam) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"


def test_a_step_computes_a_bounded_number_of_prompt_logprob_rows(hf, monkeypatch):
    """However many requests want their prompt's logprobs, a step makes a bounded number of rows of them (each a row
    of logits over the vocabulary); a policy that computes prompts whole takes only prompts that short."""
    import engine.model_runner
    import engine.scheduler

    monkeypatch.setattr(engine.scheduler, "PROMPT_LOGPROBS_BYTES", 256 * 4 * 1024)  # (256 rows of the 1,024 vocabulary)

    model, path = hf
    rows, made = [], engine.model_runner._prompt_logprobs
    monkeypatch.setattr(engine.model_runner, "_prompt_logprobs", lambda lg, t: (rows.append(len(t)), made(lg, t)))
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=512, max_num_batched_tokens=2048,
                                 long_prefill_token_threshold=2048, max_num_partial_prefills=8))
    prompts = _prompts()[3:] * 3  # 300 and 700 tokens, three of each
    outs = eng.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    assert max(rows) <= 256 == eng.scheduler.prompt_logprob_rows and sum(rows) == sum(len(p) - 1 for p in prompts)
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts))
    whole = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=512, scheduling="prefill_first"))
    (o,) = whole.generate([_prompts()[2]], SamplingParams(max_tokens=1, prompt_logprobs=0))  # (40 tokens: taken)
    assert len(o.prompt_logprobs) == 40
    with pytest.raises(InvalidSamplingParam) as e:
        whole.add_request("long", _prompts()[4], SamplingParams(prompt_logprobs=0))
    assert e.value.param == "prompt_logprobs"
