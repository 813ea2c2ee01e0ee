"""Rotary position embedding applied in place to q and k (neox halves or GPT-J interleaved pairs).

Only the first `rot_dim` dims of each head rotate (partial rotary); the math is fp32, the result is
rounded back to the input dtype. `cos_sin_cache[pos]` holds rot_dim/2 cosines then rot_dim/2 sines.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr,  # [T, H, D] (this token's row is at x_ptr + t * stride_t)
    cos, sin,  # [HALF_PAD] fp32
    stride_h,
    offs_h, offs_i,  # [H_PAD], [HALF_PAD]
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
):
    if IS_NEOX:
        off1 = offs_i  # first half pairs with second half
        off2 = offs_i + HALF
    else:
        off1 = 2 * offs_i  # even dims pair with the following odd dim
        off2 = 2 * offs_i + 1
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_i[None, :] < HALF)
    p1 = x_ptr + offs_h[:, None] * stride_h + off1[None, :]
    p2 = x_ptr + offs_h[:, None] * stride_h + off2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int32/int64
    q_ptr,  # [T, Hq, D]  rotated in place
    k_ptr,  # [T, Hkv, D] rotated in place
    cos_sin_ptr,  # [max_pos, 2 * HALF]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    i_mask = offs_i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i, mask=i_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_i, mask=i_mask, other=0.0).to(tl.float32)
    _rotate(q_ptr + t * stride_qt, cos, sin, stride_qh, tl.arange(0, HQ_PAD), offs_i, HQ, HALF, IS_NEOX)
    _rotate(k_ptr + t * stride_kt, cos, sin, stride_kh, tl.arange(0, HKV_PAD), offs_i, HKV, HALF, IS_NEOX)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim]: cos (rot_dim/2) then sin (rot_dim/2)
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rot_dim dims of each head in place and returns (q, k)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    rot_dim = cos_sin_cache.shape[1]
    assert k.shape == (T, Hkv, D), (q.shape, k.shape)
    assert rot_dim % 2 == 0 and rot_dim <= D, f"rot_dim {rot_dim} must be even and <= head_dim {D}"
    assert positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64), positions
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    assert positions.is_contiguous() and positions.device == q.device == k.device == cos_sin_cache.device
    if T > 0:
        half = rot_dim // 2
        _rotary_kernel[(T,)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            HQ=Hq, HKV=Hkv, HQ_PAD=triton.next_power_of_2(Hq), HKV_PAD=triton.next_power_of_2(Hkv),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), IS_NEOX=is_neox, num_warps=4,
        )
    return q, k


__all__ = ["rotary_embedding"]
