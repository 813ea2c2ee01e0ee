"""Writes new K/V rows into the paged cache: row t goes to slot `slot_mapping[t]`, -1 skips it.

`slot = block * block_size + offset`, so with a contiguous cache a slot is a flat row index.
One program per token copies all of its KV heads; the caches are written in place. Into an int8 or fp8
cache each head is quantized by `kernels.reference.quantize`'s rule, its scale written beside it (a GPU's fp32
division may put a value on a rounding boundary one grid step from the twin's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice_kernels.reference import QMAX


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D] (contiguous)
    v_cache_ptr,  # [num_blocks * block_size, Hkv, D] (contiguous)
    slot_mapping_ptr,  # [T] int32/int64
    k_scale_ptr,  # [num_blocks * block_size, Hkv] fp32 (QMAX > 0)
    v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    QMAX: tl.constexpr,  # 0: store as is; else the quantized dtype's largest value (127 int8, 448 fp8)
    ROUND: tl.constexpr,  # 1 int8: round half away from zero (the conversion truncates); 2 fp8 e4m3: to nearest even
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)  # int64: slot * row size can pass 2**31
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = slot * (NUM_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    t64 = t.to(tl.int64)
    # other=0: padded lanes must not count in a head's max (_quantize)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if QMAX > 0:
        k = _quantize(k.to(tl.float32), k_scale_ptr + slot * NUM_HEADS + offs_h, offs_h < NUM_HEADS, QMAX, ROUND)
        v = _quantize(v.to(tl.float32), v_scale_ptr + slot * NUM_HEADS + offs_h, offs_h < NUM_HEADS, QMAX, ROUND)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x, scale_ptrs, h_mask, QMAX: tl.constexpr, ROUND: tl.constexpr):
    """x [HEADS, D] fp32 -> x scaled so each head's largest |element| is QMAX (rounded if ROUND); stores the
    scales, max|x| / QMAX."""
    amax = tl.max(tl.abs(x), 1)  # padded elements are 0
    tl.store(scale_ptrs, amax / QMAX, mask=h_mask)
    y = x * tl.where(amax > 0, QMAX / tl.where(amax > 0, amax, 1.0), 0.0)[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if ROUND == 1:
        y = y + tl.where(y < 0, -0.5, 0.5)
        y = tl.where(y < 0, -tl.floor(-y), tl.floor(y))  # trunc
    if ROUND == 2:
        # NOTE: rounded here, so the conversion is exact: the interpreter's own fp32 -> fp8 rounds ties up and
        # drops a carry into the exponent (-127.9 became -64). An e4m3 number with exponent e is a multiple of
        # 2^(e-3), subnormals of 2^-9; adding and removing 1.5 * 2^23 steps rounds to one, ties to even.
        e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
        big = ((e - 3 + 23) << 23).to(tl.float32, bitcast=True) * 1.5
        y = (y + big) - big
    return y


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, slot = block * block_size + offset; -1 skips
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32: quantized caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    T, Hkv, D = k.shape
    qmax = QMAX.get(k_cache.dtype, 0.0)
    assert (qmax > 0) == (k_scale is not None) == (v_scale is not None), "scales come with a quantized cache only"
    if qmax:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.is_contiguous() and v_scale.is_contiguous()
    assert v.shape == k.shape, (k.shape, v.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hkv, D), (k.shape, k_cache.shape)
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v head dim must be contiguous"
    assert slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping
    assert slot_mapping.is_contiguous() and slot_mapping.device == k.device == k_cache.device
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if qmax else k_cache, v_scale if qmax else v_cache,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=Hkv, HEAD_DIM=D,
        HEADS_PAD=triton.next_power_of_2(Hkv), HEAD_DIM_PAD=triton.next_power_of_2(D),
        QMAX=qmax, ROUND={torch.int8: 1, torch.float8_e4m3fn: 2}.get(k_cache.dtype, 0), num_warps=4,
    )


__all__ = ["store_kv"]
