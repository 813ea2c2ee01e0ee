"""Native CPU rms_norm, rotary_embedding, store_kv and silu_and_mul (`csrc/elementwise_cpu.cpp`).

Each is one pass over its rows instead of 4-25 small torch ops (a decode step of a small batch is
mostly op dispatch otherwise), with the twins' roundings. A layout the C loops do not read (say, x
not 2-D) goes to the twin; a position or slot outside its cache raises before anything is written.
"""
from __future__ import annotations

import torch

from sluice_kernels import reference
from sluice_kernels.cpu.binding import DTYPES, QUANTIZED, Native, need


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    lib: Native | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    lib = need(lib)
    if (x.dim() != 2 or weight.shape != x.shape[-1:] or weight.dtype != x.dtype
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
        return reference.rms_norm(x, weight, eps, residual)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    res_out = None if residual is None else torch.empty_like(x)
    res_in = None if residual is None else residual.contiguous()
    lib.rms_norm(out.data_ptr(), x.data_ptr(), None if res_in is None else res_in.data_ptr(),
                 None if res_out is None else res_out.data_ptr(), weight.data_ptr(), DTYPES[x.dtype],
                 x.shape[0], x.shape[1], float(eps), torch.get_num_threads())
    return out if residual is None else (out, res_out)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    is_neox: bool = True,
    lib: Native | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (they must be contiguous, else the twin serves) and returns them."""
    lib = need(lib)
    T, Hq, D = q.shape
    rot = cos_sin_cache.shape[-1]
    if (not (q.is_contiguous() and k.is_contiguous()) or k.dtype != q.dtype or k.shape[0] != T or k.shape[2] != D
            or cos_sin_cache.dtype != torch.float32 or rot > D or rot % 2 or positions.device.type != "cpu"):
        return reference.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    pos = positions.to(torch.int64).contiguous()
    cs = cos_sin_cache.contiguous()
    if pos.shape != (T,):
        raise ValueError(f"positions must be [T={T}], got {tuple(positions.shape)}")
    if lib.rotary(pos.data_ptr(), q.data_ptr(), k.data_ptr(), cs.data_ptr(), cs.shape[0], DTYPES[q.dtype],
                  T, Hq, k.shape[1], D, rot, int(is_neox), torch.get_num_threads()):
        raise IndexError(f"a position is outside the rotary cache of {cs.shape[0]} positions")
    return q, k


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 skips
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32: quantized caches only
    v_scale: torch.Tensor | None = None,
    lib: Native | None = None,
) -> None:
    lib = need(lib)
    T = k.shape[0]
    row = k.shape[1:]
    # a quantized cache without its scales raises; strided scales (a copy would not be written back) take the twin
    quant = (reference.check_scales(k_cache, k_scale, v_scale) and k.dtype in DTYPES and k_scale.is_contiguous()
             and v_scale.is_contiguous())
    if ((k.dtype != k_cache.dtype and not quant) or v.dtype != k.dtype or v_cache.dtype != k_cache.dtype
            or v.shape != k.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != row
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    k, v = k.contiguous(), v.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (T,):
        raise ValueError(f"slot_mapping must be [T={T}], got {tuple(slot_mapping.shape)}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if quant:
        err = lib.store_kv_quant(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(),
                                 v_scale.data_ptr(), slots.data_ptr(), T, row[0], row[1], DTYPES[k.dtype],
                                 QUANTIZED[k_cache.dtype], num_slots)
    else:
        err = lib.store_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), T,
                           k[0].numel() * k.element_size() if T else 0, num_slots)
    if err:
        raise IndexError(f"a slot is outside the KV cache of {num_slots} slots")


def silu_and_mul(x: torch.Tensor, lib: Native | None = None) -> torch.Tensor:  # [..., 2d] -> [..., d]
    lib = need(lib)
    if x.shape[-1] % 2:  # the halves differ in size: the twin raises the shape error
        return reference.silu_and_mul(x)
    d = x.shape[-1] // 2
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    lib.silu_and_mul(out.data_ptr(), x.data_ptr(), DTYPES[x.dtype], out.numel() // d if d else 0, d,
                     torch.get_num_threads())
    return out
