"""Paged attention over a whole mixed batch (prefill chunks + decodes) in one Triton launch.

A program owns `BLOCK_Q` query tokens of one sequence times every query head of one KV head's
group, so each K/V tile is read once per group; softmax is online, in fp32, base 2. The launcher
reads no device tensor (no host sync): the grid depends on tensor shapes only. A quantized cache (int8,
fp8) is read as stored: a key's scale multiplies its scores; a value tile is scaled in fp32 before the dot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice_kernels.reference import QMAX

LOG2E = 1.4426950408889634
# Split-KV only pays when a decode batch leaves most SMs idle; below this many cached tokens per
# split the extra merge pass costs more than it hides.
MIN_SPLIT_TOKENS = 512
MAX_SPLITS = 16
_NUM_SMS: dict[int, int] = {}


@triton.jit
def _kv_tile(
    acc, m_i, l_i,  # [M, D_PAD] fp32, [M] fp32, [M] fp32: running output, max, sum
    q,  # [M, D_PAD]
    kv_start, kv_hi, row_pos, qk_scale,
    k_base, v_base,  # k_cache / v_cache pointers offset to (block 0, slot 0, this kv head)
    ks_base, vs_base,  # their scales, offset the same way (QUANT)
    bt_ptr,  # [max_blocks] int32: this sequence's block table row
    stride_kb, stride_kt, stride_sb, stride_st,
    offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, COMPUTE_DT: tl.constexpr,
    DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
):
    kpos = kv_start + offs_n  # [BLOCK_N] logical key positions
    if MASKED:
        n_mask = kpos < kv_hi
        blk = tl.load(bt_ptr + kpos // BLOCK_SIZE, mask=n_mask, other=0)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        blk = tl.load(bt_ptr + kpos // BLOCK_SIZE)
        kv_mask = d_mask[None, :]
    # NOTE: int64 before multiplying: one layer's cache can exceed 2**31 elements.
    off = blk.to(tl.int64) * stride_kb + (kpos % BLOCK_SIZE) * stride_kt  # [BLOCK_N]
    kv_off = off[:, None] + offs_d[None, :]  # [BLOCK_N, D_PAD]
    k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0).to(COMPUTE_DT)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, BLOCK_N]
    if QUANT:
        s_off = blk.to(tl.int64) * stride_sb + (kpos % BLOCK_SIZE) * stride_st  # [BLOCK_N]
        n_ok = kpos < kv_hi
        s = s * tl.load(ks_base + s_off, mask=n_ok, other=0.0)[None, :]
    if MASKED:
        s = tl.where(n_mask[None, :] & (kpos[None, :] <= row_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:  # NOTE: V itself scaled, in fp32: p * scale would sink into fp16's subnormals
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = (v * tl.load(vs_base + s_off, mask=n_ok, other=0.0)[:, None]).to(COMPUTE_DT)
    else:
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0).to(COMPUTE_DT)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DT), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]                       written when NUM_SPLITS == 1
    part_acc_ptr,  # [NUM_SPLITS, T, Hq, D] fp32  unnormalised partial outputs (NUM_SPLITS > 1)
    part_ml_ptr,  # [NUM_SPLITS, T, Hq, 2] fp32   partial (max, sum) in base 2 (NUM_SPLITS > 1)
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, Hkv] fp32 (QUANT)
    v_scale_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32, context length including the new tokens
    qk_scale,  # softmax scale * log2(e)
    num_seqs, num_tokens, num_q_heads, split_len,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt, stride_sb, stride_st,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, COMPUTE_DT: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence b owns tile slots [start(b), start(b+1)) with start(b) = (cu[b] + b*(BLOCK_Q-1)) // BLOCK_Q,
    # at least cdiv(q_len_b, BLOCK_Q) of them; start is non-decreasing, so binary-search it.
    lo = 0
    hi = num_seqs
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if (tl.load(cu_seqlens_q_ptr + mid) + mid * (BLOCK_Q - 1)) // BLOCK_Q <= pid:
            lo = mid
        else:
            hi = mid
    b = lo
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    q_off = (pid - (q_start + b * (BLOCK_Q - 1)) // BLOCK_Q) * BLOCK_Q
    if q_off >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + b)

    # Row r of the tile is query token q_off + r // GROUP_PAD in head kvh*GROUP + r % GROUP_PAD.
    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_off + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_mask = (tok < q_len) & (g < GROUP)
    row_pos = ctx - q_len + tok  # absolute position: sees keys at positions <= its own
    head = kvh * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    row_t = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row_t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(COMPUTE_DT)  # [M, D_PAD]

    kv_lo = split * split_len
    kv_hi = tl.minimum(ctx - q_len + tl.minimum(q_off + BLOCK_Q, q_len), kv_lo + split_len)
    # Keys before the tile's first position are visible to every row: those tiles skip the mask.
    full_hi = tl.minimum(ctx - q_len + q_off + 1, kv_hi)
    full_hi = kv_lo + tl.maximum(full_hi - kv_lo, 0) // BLOCK_N * BLOCK_N

    # NOTE: a finite floor for the running max keeps exp2(m_old - m_new) NaN-free for rows that
    # see no key in this split (split-KV) or in a fully masked tile.
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_kh
    ks_base = k_scale_ptr + kvh  # a scale tensor's head stride is 1
    vs_base = v_scale_ptr + kvh
    bt_ptr = block_tables_ptr + b * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _kv_tile(
            acc, m_i, l_i, q, start, kv_hi, row_pos, qk_scale, k_base, v_base, ks_base, vs_base, bt_ptr,
            stride_kb, stride_kt, stride_sb, stride_st, offs_n, offs_d, d_mask, BLOCK_SIZE, False, COMPUTE_DT,
            DOT_PREC, QUANT,
        )
    for start in range(full_hi, kv_hi, BLOCK_N):
        acc, m_i, l_i = _kv_tile(
            acc, m_i, l_i, q, start, kv_hi, row_pos, qk_scale, k_base, v_base, ks_base, vs_base, bt_ptr,
            stride_kb, stride_kt, stride_sb, stride_st, offs_n, offs_d, d_mask, BLOCK_SIZE, True, COMPUTE_DT,
            DOT_PREC, QUANT,
        )

    io_mask = row_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (split * num_tokens + row_t) * num_q_heads + head  # [M] int64
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [NUM_SPLITS, T, Hq, D] fp32
    part_ml_ptr,  # [NUM_SPLITS, T, Hq, 2] fp32
    num_tokens, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    part = (offs_s.to(tl.int64) * num_tokens + t) * num_q_heads + h  # [S]
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    w = tl.math.exp2(m - tl.max(m, 0))  # [S]; empty splits carry m = -1e30, so w = 0
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [S, D_PAD]
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: pretend to be an H200 so the split heuristic is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _choose_splits(decode_only: bool, programs: int, max_ctx: int, device: torch.device) -> int:
    """Split-KV for decode batches too small to fill the GPU; `max_ctx` is the block-table bound."""
    sms = _num_sms(device)
    if not decode_only or programs >= sms or max_ctx < 2 * MIN_SPLIT_TOKENS:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_ctx // MIN_SPLIT_TOKENS, MAX_SPLITS))


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
    *,
    num_splits: int | None = None,  # None: chosen from the batch shape; tests force it
    block_n: int | None = None,  # KV tile; tests shrink it to cross tiles with tiny shapes
) -> torch.Tensor:  # [T, Hq, D]
    T, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    B = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape and Dk == D, (q.shape, k_cache.shape, v_cache.shape)
    assert Hq % Hkv == 0, f"GQA needs Hq ({Hq}) to be a multiple of Hkv ({Hkv})"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    quant = k_cache.dtype in QMAX
    assert quant == (k_scale is not None) == (v_scale is not None), "scales come with a quantized cache only"
    if quant:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.is_contiguous() and v_scale.is_contiguous(), "KV scales must be contiguous"
    else:
        k_scale = v_scale = k_cache  # unused by the kernel
    assert q.stride(2) == 1, "q's head dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert block_size >= 1 and block_size & (block_size - 1) == 0, f"block_size {block_size} not a power of two"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B and block_tables.stride(1) == 1
    assert cu_seqlens_q.shape == (B + 1,) and cu_seqlens_q.is_contiguous() and seq_lens.is_contiguous()
    for t in (block_tables, cu_seqlens_q, seq_lens):
        assert t.dtype == torch.int32, f"metadata must be int32, got {t.dtype}"
        assert t.device == q.device == k_cache.device, "all tensors must share one device"
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out

    group = Hq // Hkv
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(D))
    decode_only = T == B  # the usual decode step: then a tile is one token's head group
    block_q = max(1, (16 if decode_only else 64) // group_pad)  # tl.dot needs >= 16 rows
    if block_n is None:
        block_n = 64 if head_dim_pad <= 128 else 32
    assert block_n >= 16 and block_n & (block_n - 1) == 0, block_n
    max_ctx = block_tables.shape[1] * block_size
    grid_q = (T + B * (block_q - 1)) // block_q  # = start(B): every sequence's tile slots
    if num_splits is None:
        num_splits = _choose_splits(decode_only, grid_q * Hkv, max_ctx, q.device)
    split_len = triton.cdiv(triton.cdiv(max(max_ctx, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_ctx, 1), split_len)  # drop splits that would always be empty
    if num_splits > 1:
        part_acc = torch.empty((num_splits, T, Hq, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_splits, T, Hq, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused by the kernel
    # The interpreter keeps bf16 as raw uint16 and cannot do arithmetic on it: compute in fp32 there.
    compute_dt = tl.float32 if (q.dtype == torch.float32 or triton.knobs.runtime.interpret) else (
        tl.float16 if q.dtype == torch.float16 else tl.bfloat16)

    _paged_attention_kernel[(grid_q, Hkv, num_splits)](
        out, part_acc, part_ml, q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens,
        scale * LOG2E, B, T, Hq, split_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        block_size * Hkv, Hkv,
        HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        COMPUTE_DT=compute_dt, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant,
        num_warps=4 if head_dim_pad <= 64 else 8, num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(T, Hq)](
            out, part_acc, part_ml, T, Hq, out.stride(0), out.stride(1),
            HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), num_warps=4,
        )
    return out


__all__ = ["paged_attention"]
