"""`sluice_kernels/__init__.py`: one function picks the backend per call, as the table in docs/architecture.md §8 says,
and every backend offers each public op under the public op's signature."""
from __future__ import annotations

import inspect

import pytest
import torch

import sluice_kernels as kernels
from engine import EngineConfig, LLMEngine, SamplingParams
from sluice_kernels import cpu, reference, triton
from sluice_kernels.cpu import binding
from tests.kernels.common import TOLERANCES, paged_batch

OPS = ("paged_attention", "store_kv", "rms_norm", "rotary_embedding", "silu_and_mul")
ELEMENTWISE = OPS[1:]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # only the device type is read: no GPU needed


@pytest.mark.parametrize("op", OPS)
def test_every_backend_takes_the_public_signature(op):
    """A backend may add parameters after the public ones (tests force `num_splits`, pass `lib`), never before."""
    public = list(inspect.signature(getattr(kernels, op)).parameters)
    for backend in (reference, cpu, triton):
        assert list(inspect.signature(getattr(backend, op)).parameters)[: len(public)] == public, backend.__name__


@pytest.mark.parametrize("mode,device,loaded,want", [
    ("auto", CUDA, True, "triton"),
    ("auto", CPU, True, "cpu-native"),
    ("auto", CPU, False, "torch"),
    ("triton", CPU, True, "triton"),
    ("torch", CUDA, True, "torch"),
    ("torch", CPU, True, "torch"),
])
def test_the_dispatch_table(monkeypatch, native_builds, mode, device, loaded, want):
    monkeypatch.setattr(kernels, "MODE", mode)
    monkeypatch.setattr(binding, "_lib", native_builds["native"] if loaded else None)
    assert [kernels._backend(op, device, torch.float32) for op in OPS] == [want] * len(OPS)
    assert kernels.attention_backend(device) == want


def test_fp16_elementwise_ops_stay_on_the_twins(monkeypatch, native_builds):
    """The native fp16 loops run scalar (no vector fp16 conversion): the dispatcher keeps them on torch."""
    monkeypatch.setattr(kernels, "MODE", "auto")
    monkeypatch.setattr(binding, "_lib", native_builds["native"])
    assert kernels._backend("paged_attention", CPU, torch.float16) == "cpu-native"
    assert all(kernels._backend(op, CPU, torch.bfloat16) == "cpu-native" for op in ELEMENTWISE)
    assert not any(kernels._backend(op, CPU, torch.float16) == "cpu-native" for op in ELEMENTWISE)


def test_dispatch_routes_to_triton(monkeypatch):
    """`kernels.paged_attention` takes the Triton path under SLUICE_KERNELS=triton semantics."""
    calls = []
    real = triton.paged_attention
    monkeypatch.setattr(kernels, "MODE", "triton")
    monkeypatch.setattr(triton, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    b = paged_batch([11], [13], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    out = kernels.paged_attention(*b.args(), 0.25)
    assert calls == [1]
    torch.testing.assert_close(out, reference.paged_attention(*b.args(), 0.25), **TOLERANCES[torch.float32])


def test_a_forward_on_native_ops_matches_the_twins(tiny_model_dir, monkeypatch):
    """The whole model: every op native (as the engine runs on CPU) vs every op a twin, same greedy tokens."""
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_model_len=256))
    assert kernels.attention_backend(torch.device("cpu")) == "cpu-native"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i * 13 % 900 for i in range(n)] for n in (3, 40, 97)]
    native = eng.generate(prompts, params)
    monkeypatch.setattr(kernels, "MODE", "torch")  # the dispatch reads it per call
    twins = eng.generate(prompts, params)
    for a, b in zip(native, twins, strict=True):
        assert a.token_ids == b.token_ids


def test_the_cache_dtype_joins_the_dispatch(monkeypatch, native_builds):
    """The native kernels read a cache of q's dtype or a quantized one; another float cache goes to the twin."""
    monkeypatch.setattr(kernels, "MODE", "auto")
    monkeypatch.setattr(binding, "_lib", native_builds["native"])
    for cache in (None, torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        assert kernels._backend("paged_attention", CPU, torch.bfloat16, cache) == "cpu-native"
        assert kernels._backend("store_kv", CPU, torch.bfloat16, cache) == "cpu-native"
    assert kernels._backend("paged_attention", CPU, torch.float32, torch.float16) == "torch"
    assert kernels.attention_backend(CPU, torch.float32, torch.bfloat16) == "torch"
    assert kernels.attention_backend(CPU, torch.bfloat16, torch.int8) == "cpu-native"
    assert kernels._backend("paged_attention", CUDA, torch.bfloat16, torch.int8) == "triton"
