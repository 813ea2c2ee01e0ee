"""Quantized KV caches (int8, fp8 e4m3; one fp32 scale per token and KV head): `reference.quantize` is the rule,
the native and Triton `store_kv` follow it, and every backend's `paged_attention` reads such a cache as the twin
does, which equals attention over the dequantized cache."""
from __future__ import annotations

import pytest
import torch

from sluice_kernels import reference
from sluice_kernels.cpu import attention as cpu_attention
from sluice_kernels.cpu import elementwise as cpu_elementwise
from sluice_kernels.triton import attention as triton_attention
from sluice_kernels.triton import cache as triton_cache
from tests.kernels.common import DEVICE, DTYPES, TOLERANCES, PagedBatch, paged_batch

QUANT = [torch.int8, torch.float8_e4m3fn]
MIXED = ([1, 7, 1, 12, 1, 40, 0], [30, 9, 0, 0, 16, 25, 5])  # decodes, chunks, a whole prompt, an idle row


def _quantized(b: PagedBatch, dtype: torch.dtype) -> tuple:
    """`b`'s caches quantized: the args of paged_attention with (k_scale, v_scale) after `scale`."""
    nb, bs, H, D = b.k_cache.shape
    parts = []
    for c in (b.k_cache, b.v_cache):
        q, s = reference.quantize(c.reshape(-1, H, D), dtype)
        parts.append((q.view(nb, bs, H, D), s.view(nb, bs, H)))
    (kq, ks), (vq, vs) = parts
    return (b.q, kq, vq, b.block_tables, b.cu_seqlens_q, b.seq_lens, 0.3, ks, vs)


@pytest.mark.parametrize("dtype", QUANT, ids=str)
def test_quantize_rule(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0.0  # an all-zero head: scale 0, values 0
    q, s = reference.quantize(x, dtype)
    assert q.dtype == dtype and s.dtype == torch.float32 and s.shape == (50, 3)
    qmax = reference.QMAX[dtype]
    assert q.float().abs().amax(-1)[s > 0].eq(qmax).all()  # each head's largest element lands on QMAX
    assert s[7, 1] == 0 and not q[7, 1].float().any()
    err = (q.float() * s[..., None] - x).abs() / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert err.max() <= (0.5 / 127 if dtype == torch.int8 else 2**-4) * 1.0001  # half a step of the grid
    if dtype == torch.int8:  # halves round away from zero
        q, s = reference.quantize(torch.tensor([[[127.0, 0.5, -0.5, 1.5, -2.5]]]), dtype)
        assert q.tolist() == [[[127, 1, -1, 2, -3]]] and s.item() == 1.0


def _store_inputs(dtype: torch.dtype, cache_dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(1)
    T, H, D, nb, bs = 9, 2, 24, 5, 8
    qkv = (torch.randn(T, 4 + 2 * H, D, generator=g) * 3).to(dtype).to(device)  # k, v: strided views
    k, v = qkv[:, 4:4 + H], qkv[:, 4 + H:]
    k[2] = 0  # an all-zero row, stored at slot 17
    slots = torch.tensor([3, -1, 17, 8, -1, 39, 0, 5, 6], device=device)
    caches = [[torch.zeros(nb, bs, H, D, dtype=cache_dtype, device=device) for _ in range(2)],
              [torch.zeros(nb, bs, H, device=device) for _ in range(2)]]
    return k, v, slots, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cache_dtype", QUANT, ids=str)
@pytest.mark.parametrize("build", ["native", "no-avx512", "plain"])
def test_native_store_equals_the_twin(native_builds, build, dtype, cache_dtype):
    if build not in native_builds:
        pytest.skip("x86-only build variant")
    k, v, slots, (ref_kv, ref_s) = _store_inputs(dtype, cache_dtype)
    _, _, _, (kv, s) = _store_inputs(dtype, cache_dtype)
    reference.store_kv(k, v, *ref_kv, slots, *ref_s)
    cpu_elementwise.store_kv(k, v, *kv, slots, *s, lib=native_builds[build])
    for a, b in zip(kv, ref_kv):  # bit for bit: the same fp32 operations in the same order
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(s, ref_s))
    assert not ref_s[0].view(-1, 2)[17].any() and not ref_kv[0].view(-1, 2, 24)[17].float().any()  # the zero row
    assert ref_s[0].view(-1, 2)[3].gt(0).all() and not ref_s[0].view(-1, 2)[1].any()  # slot 1: no row went there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", QUANT, ids=str)
def test_triton_store_follows_the_rule(dtype, cache_dtype):
    """Scales equal; a value may land one grid step off the twin's only where the fp32 product sits on a rounding
    boundary (a GPU's division is not the CPU's)."""
    k, v, slots, (kv, s) = _store_inputs(dtype, cache_dtype, DEVICE)
    _, _, _, (ref_kv, ref_s) = _store_inputs(dtype, cache_dtype, DEVICE)
    triton_cache.store_kv(k, v, *kv, slots, *s)
    reference.store_kv(k, v, *ref_kv, slots, *ref_s)
    for a, b in zip(s, ref_s):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    for a, b in zip(kv, ref_kv):
        diff = (a.float() - b.float()).abs()
        step = 1.0 if cache_dtype == torch.int8 else b.float().abs().clamp_min(2**-6) / 8  # e4m3: 3 mantissa bits
        assert (diff <= step * 1.0001).all() and diff.gt(0).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", QUANT, ids=str)
def test_twin_reads_the_dequantized_cache(dtype, cache_dtype):
    b = paged_batch(*MIXED, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
    args = _quantized(b, cache_dtype)
    out = reference.paged_attention(*args)
    deq = [(c.float() * s[..., None]) for c, s in ((args[1], args[7]), (args[2], args[8]))]
    want = reference.paged_attention(b.q.float(), *deq, *args[3:7])
    torch.testing.assert_close(out.float(), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", QUANT, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("build", ["native", "no-avx512", "plain"])
def test_native_attention_equals_the_twin(native_builds, build, dtype, cache_dtype, head_dim):
    if build not in native_builds:
        pytest.skip("x86-only build variant")
    b = paged_batch(*MIXED, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)
    args = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in _quantized(b, cache_dtype))
    ref = reference.paged_attention(*args)
    for max_q_len in (16, 1 << 30):  # the 40-token prompt: the gathered prefill path, then the native kernel
        out = cpu_attention.paged_attention(*args, max_q_len=max_q_len, lib=native_builds[build])
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", [*QUANT, torch.float16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_equals_the_twin(dtype, cache_dtype, num_splits):
    b = paged_batch([1, 7, 1, 12, 1], [30, 9, 0, 0, 16], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                    dtype=dtype)
    if cache_dtype in reference.QMAX:
        args = _quantized(b, cache_dtype)
    else:  # a cache in another float dtype than the model's (fp16 KV for an fp32 or bf16 model)
        args = (b.q, b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype), *b.args()[3:], 0.3, None, None)
    out = triton_attention.paged_attention(*args, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, reference.paged_attention(*args), **TOLERANCES[dtype])


def test_bad_scales_are_refused(native_builds):
    b = paged_batch([1, 3], [20, 5], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    args = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in _quantized(b, torch.int8))
    lib = native_builds["native"]
    with pytest.raises(TypeError, match="scale"):
        cpu_attention.paged_attention(*args[:7], lib=lib)  # an int8 cache without its scales
    with pytest.raises(TypeError, match="scale"):
        cpu_attention.paged_attention(*b.args(), 0.3, args[7], args[8], lib=lib)  # scales with a float cache
    with pytest.raises(ValueError, match="fp32"):
        cpu_attention.paged_attention(*args[:7], args[7][:-1], args[8][:-1], lib=lib)
    with pytest.raises(TypeError, match="q's dtype"):  # an unquantized cache of another dtype: the twin serves it
        cpu_attention.paged_attention(b.q.cpu(), b.k_cache.cpu().half(), b.v_cache.cpu().half(), *args[3:7], lib=lib)


def test_a_quantized_cache_never_takes_values_without_its_scales(native_builds):
    """Without scales an int8 store would wrap (186 -> -70): every backend refuses instead, as it refuses
    misshapen scales, and scales with a float cache."""
    k, v, slots, (kv, s) = _store_inputs(torch.float32, torch.int8)
    lib = native_builds["native"]
    for store in (reference.store_kv, lambda *a: cpu_elementwise.store_kv(*a, lib=lib)):
        with pytest.raises(TypeError, match="scale"):
            store(k, v, *kv, slots)
        with pytest.raises(ValueError, match="fp32"):
            store(k, v, *kv, slots, s[0].view(-1, 1, 2), s[1].view(-1, 1, 2))  # as many elements, not the shape
        with pytest.raises(TypeError, match="scale"):
            store(k, v, k.new_zeros(5, 8, 2, 24), k.new_zeros(5, 8, 2, 24), slots, *s)
    assert not any(c.any() for c in kv) and not any(t.any() for t in s)  # nothing was written
    b = paged_batch([1], [20], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    args = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in _quantized(b, torch.int8))
    with pytest.raises(TypeError, match="scale"):
        reference.paged_attention(*args[:7])
