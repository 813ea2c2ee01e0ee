"""`engine.models.llama.Linear`: bf16 weights on CPU are prepacked for oneDNN, with F.linear's exact results."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.models.llama as llama
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.llama import Linear, prepacks

needs_packing = pytest.mark.skipif(not prepacks(torch.empty(1, dtype=torch.bfloat16)),
                                   reason="oneDNN on this CPU has no native bf16")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_bf16_weights_give_f_linears_bits(bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    lin = Linear(w, b)
    assert lin.packed is not None and lin.weight is None  # only the packed copy is kept
    for T in (0, 1, 17, 300):
        x = torch.randn(T, 64, generator=g).bfloat16()
        assert torch.equal(lin(x), F.linear(x, w, b))


def test_other_weights_stay_plain():
    w = torch.randn(8, 4)
    assert Linear(w).packed is None  # fp32: the correctness tests' dtype, MKL's sgemm
    assert Linear(w.bfloat16(), pack=False).packed is None  # a head tied to the embedding table
    assert torch.equal(Linear(w)(torch.ones(2, 4)), F.linear(torch.ones(2, 4), w))


@needs_packing
def test_a_bf16_engine_generates_the_same_with_and_without_packing(tiny_model_dir, monkeypatch):
    prompts = [[5, 9, 100, 7] * 10, [3] * 70, list(range(20, 45))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)

    def run():
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", max_num_batched_tokens=64, seed=0))
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in eng.generate(prompts, params)]

    packed = run()
    monkeypatch.setattr(llama, "prepacks", lambda w: False)
    assert run() == packed
