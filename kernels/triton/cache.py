"""Writes new K/V rows into the paged cache: row t goes to slot `slot_mapping[t]`, -1 skips it.

`slot = block * block_size + offset`, so with a contiguous cache a slot is a flat row index.
One program per token copies all of its KV heads; the caches are written in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D] (contiguous)
    v_cache_ptr,  # [num_blocks * block_size, Hkv, D] (contiguous)
    slot_mapping_ptr,  # [T] int32/int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
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
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, slot = block * block_size + offset; -1 skips
) -> None:
    T, Hkv, D = k.shape
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
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=Hkv, HEAD_DIM=D,
        HEADS_PAD=triton.next_power_of_2(Hkv), HEAD_DIM_PAD=triton.next_power_of_2(D),
        num_warps=4,
    )


__all__ = ["store_kv"]
