"""Torch twins of the kernels in `sluice_kernels/`: the CPU path and the ground truth for kernel tests.

Every op here has the same signature and semantics as its Triton version (docs/architecture.md §8).
Clarity over speed, but no per-token Python loops: one gather per sequence at most.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The quantized cache dtypes and the largest magnitude each holds: a token's head is scaled so its largest
# element lands there (docs/architecture.md §8, Quantized KV).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [T, H, D] -> (q [T, H, D] of `dtype`, scale [T, H] fp32) with `x ~= q * scale`: one scale per token and
    head, `max|x| / QMAX`. int8 rounds half away from zero; fp8 rounds to nearest even. Every backend does this."""
    qmax = QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = amax / qmax
    # NOTE: a tensor over a tensor: `qmax / amax` would be `amax.reciprocal() * qmax`, rounded differently
    inv = torch.full_like(amax, qmax) / torch.where(amax > 0, amax, 1.0)
    y = xf * torch.where(amax > 0, inv, 0.0)[..., None]
    if dtype == torch.int8:
        y = (y + torch.copysign(torch.full_like(y, 0.5), y)).trunc()
    return y.clamp(-qmax, qmax).to(dtype), scale


def check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether `cache` is quantized; raises unless its scales come with it (fp32 [num_blocks, block_size, Hkv])
    and only with it."""
    quant = cache.dtype in QMAX
    if quant != (k_scale is not None) or quant != (v_scale is not None):
        raise TypeError("k_scale and v_scale come with a quantized (int8 / fp8) cache, and only with one")
    if quant and not (k_scale.dtype == v_scale.dtype == torch.float32
                      and tuple(k_scale.shape) == tuple(v_scale.shape) == tuple(cache.shape[:3])):
        raise ValueError(f"k_scale and v_scale must be fp32 {list(cache.shape[:3])}: {tuple(k_scale.shape)} "
                         f"{k_scale.dtype}, {tuple(v_scale.shape)} {v_scale.dtype}")
    return quant


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, slot = block * block_size + offset; -1 skips
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32: quantized caches only
    v_scale: torch.Tensor | None = None,
) -> None:
    check_scales(k_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x[keep]
        if scales is not None:
            x, s = quantize(x, cache.dtype)
            scales.view(-1, scales.shape[2]).index_copy_(0, slots, s)
        # NOTE: through bytes: index_copy_ has no fp8 kernel on CPU
        cache.view(-1, *cache.shape[2:]).view(torch.uint8).index_copy_(0, slots, x.to(cache.dtype).view(torch.uint8))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int, dtype: torch.dtype,
            scales: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of the first `num_blocks` blocks of each table, as `dtype` (dequantized with `scales` where given):
    [B, num_blocks * block_size, Hkv, D]."""
    nb_total, bs = cache.shape[:2]
    idx = block_table[..., :num_blocks].reshape(-1).long()
    # NOTE: index_select on a 2-D view copies whole blocks at once; ~10x faster than fancy indexing.
    rows = cache.view(nb_total, -1).index_select(0, idx).view(-1, num_blocks * bs, *cache.shape[2:])
    if scales is None:
        return rows.to(dtype)
    s = scales.view(nb_total, -1).index_select(0, idx).view(-1, num_blocks * bs, scales.shape[2], 1)
    return (rows.float() * s).to(dtype)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D], new tokens of all sequences back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new tokens
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32: quantized caches only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    check_scales(k_cache, k_scale, v_scale)
    Hq = q.shape[1]
    Hkv, bs = k_cache.shape[2], k_cache.shape[1]
    gqa = Hq != Hkv
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(lens))]
    # NOTE: decodes are batched per power-of-two bucket of block count, so one long context does not pad
    # every other decode to its length; a lone decode and prefill chunks go one by one.
    buckets: dict[int, list[int]] = {}
    for b, n in enumerate(q_lens):
        if n == 1:
            buckets.setdefault((-(-lens[b] // bs) - 1).bit_length(), []).append(b)
    done: set[int] = set()
    for grp in buckets.values():
        if len(grp) < 2:
            continue
        nb = -(-max(lens[b] for b in grp) // bs)
        idx = torch.tensor(grp)
        k = _gather(k_cache, block_tables[idx], nb, q.dtype, k_scale).transpose(1, 2)  # (B, Hkv, L, D)
        v = _gather(v_cache, block_tables[idx], nb, q.dtype, v_scale).transpose(1, 2)
        rows = torch.tensor([cu[b] for b in grp])
        dev = q.device  # SDPA refuses a CPU mask for CUDA inputs
        mask = torch.arange(nb * bs, device=dev)[None, :] < torch.tensor([lens[b] for b in grp], device=dev)[:, None]
        o = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa
        )  # (B, Hq, 1, D)
        out[rows] = o.squeeze(2)
        done.update(grp)
    for b, n in enumerate(q_lens):
        if n == 0 or b in done:
            continue
        L = lens[b]
        k = _gather(k_cache, block_tables[b], -(-L // bs), q.dtype, k_scale)[:, :L].transpose(1, 2)  # (1, Hkv, L, D)
        v = _gather(v_cache, block_tables[b], -(-L // bs), q.dtype, v_scale)[:, :L].transpose(1, 2)
        # NOTE: 4-D, not 3-D: CPU SDPA sends 3-D inputs to the math path (an n x L score matrix per head).
        qb = q[cu[b] : cu[b + 1]].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
        if n == L or n == 1:
            mask, causal = None, n > 1
        else:
            # query i sits at position L - n + i and sees keys at positions <= its own
            mask = torch.arange(L, device=q.device)[None, :] <= (L - n + torch.arange(n, device=q.device))[:, None]
            causal = False
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[cu[b] : cu[b + 1]] = o[0].transpose(0, 1)  # (n, Hq, D)
    return out


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim]: cos (rot_dim/2) then sin (rot_dim/2)
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rot_dim dims of each head in place and returns (q, k)."""
    cs = cos_sin_cache[positions.long()]  # (T, rot_dim)
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half].float(), cs[:, None, half:].float()
    for x in (q, k):
        rot = x[..., : 2 * half].float()
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
            x[..., : 2 * half] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            x[..., : 2 * half] = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2).to(x.dtype)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2d] -> [..., d]
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
