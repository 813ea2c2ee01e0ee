"""Native CPU paged attention: `csrc/paged_attention_cpu.cpp` reads the paged KV cache in place.

The torch twin gathers every sequence's KV blocks into a fresh tensor per layer and then runs SDPA; on
CPU that copy was most of a decode step. Prefill chunks longer than `MAX_Q_LEN` go, in bf16 on CPUs
with AMX or AVX512-BF16, to `csrc/prefill_attention_cpu.cpp` (one pass over the paged context in tile matmuls:
AMX's, or vdpbf16ps's rows of them); elsewhere they gather and take CPU SDPA's flash kernel, twice (context, then
the chunk itself, causal), merged. A quantized cache (int8, fp8) is read in place by the native kernel; prefill
chunks gather it dequantized. Bad inputs raise before anything is read.
"""
from __future__ import annotations

import itertools

import torch

from sluice_kernels import reference
from sluice_kernels.cpu.binding import DTYPES, ERRORS, QUANTIZED, UNSUPPORTED, Native, need

MAX_Q_LEN = 16  # longer query runs (prefill chunks) go to _prefill_attention


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, rows may be strided
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32: quantized caches only
    v_scale: torch.Tensor | None = None,
    max_q_len: int = MAX_Q_LEN,
    lib: Native | None = None,
) -> torch.Tensor:
    """`kernels.paged_attention`'s contract; sequences with more than `max_q_len` new tokens take the prefill path."""
    lib = need(lib)
    T, Hq, D = q.shape
    nb, bs, Hkv, Dk = k_cache.shape
    B = seq_lens.shape[0]
    quant = k_cache.dtype in QUANTIZED
    if not (q.dtype in DTYPES and k_cache.dtype == v_cache.dtype and (quant or k_cache.dtype == q.dtype)):
        raise TypeError(f"q must be one of {list(DTYPES)} and the caches q's dtype or one of {list(QUANTIZED)}: "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if reference.check_scales(k_cache, k_scale, v_scale):
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    if v_cache.shape != k_cache.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if block_tables.dtype != torch.int32 or cu_seqlens_q.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_tables, cu_seqlens_q and seq_lens must be int32")
    if cu_seqlens_q.shape != (B + 1,) or block_tables.dim() != 2 or block_tables.shape[0] < B:
        raise ValueError("cu_seqlens_q must be [B + 1] and block_tables [>= B, max_blocks] for B = len(seq_lens)")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    cu_seqlens_q, seq_lens = cu_seqlens_q.contiguous(), seq_lens.contiguous()
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or cu[-1] != T or any(a > b for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens_q must rise from 0 to T={T}")
    out = torch.empty_like(q)
    err = lib.paged_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), DTYPES[q.dtype],
        QUANTIZED[k_cache.dtype] if quant else DTYPES[q.dtype], k_scale.data_ptr() if quant else None,
        v_scale.data_ptr() if quant else None,
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
        cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), B,
        Hq, Hkv, D, bs, nb, float(scale), max_q_len, torch.get_num_threads(),
    )
    if err:
        raise ValueError(f"paged_attention: {ERRORS.get(err, f'error {err}')}")
    for b in range(B):  # prefill chunks: AMX tiles, or gather once and SDPA's flash kernel
        n = cu[b + 1] - cu[b]
        if n > max_q_len:
            L = int(seq_lens[b])  # (only here: a tensor's item costs microseconds, and a decode batch has hundreds)
            if n > L:  # as the native kernel checks the shorter ones
                raise ValueError(f"paged_attention: {ERRORS[2]}")
            out[cu[b] : cu[b + 1]] = _prefill_attention(q[cu[b] : cu[b + 1]], k_cache, v_cache, block_tables[b],
                                                        L, scale, lib, k_scale, v_scale)
    return out


def _flash_op():
    try:  # (output, logsumexp); torch's CPU flash kernel, which `scaled_dot_product_attention` calls
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


_FLASH = _flash_op()


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, L: int,
              lib: Native | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first L tokens of a sequence's K and V, head-major: two [1, Hkv, L, D] tensors of the caches' dtype."""
    lib = need(lib)
    nb, bs, Hkv, D = k_cache.shape
    if table.dtype != torch.int32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise TypeError("gather_kv: the block table must be int32 and the caches contiguous")
    if -(-L // bs) > table.shape[0]:
        raise ValueError(f"a context of {L} tokens needs more blocks than the table's {table.shape[0]}")
    k = torch.empty(1, Hkv, L, D, dtype=k_cache.dtype)
    v = torch.empty_like(k)
    table = table.contiguous()
    if lib.gather_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), L, bs,
                     Hkv, D, k_cache.element_size(), nb, torch.get_num_threads()):
        raise ValueError("paged_attention: " + ERRORS[1])
    return k, v


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                       L: int, scale: float, lib: Native, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """n new tokens at positions L-n..L-1 of one sequence -> [n, Hq, D].

    bf16 with AMX or AVX512-BF16 and a head dim that is a multiple of 32 (up to 256): the native kernel, one pass
    (`Native.prefill`), in AMX tiles where the head dim is a multiple of 64 too.
    Otherwise SDPA's flash kernel; its causal mask is aligned top-left, a chunk's is bottom-right, so
    instead of an n x L mask (built per layer, and no masked tile skipped) this runs two flash passes:
    the chunk over its cached context (no mask) and over itself (causal, which is then aligned), merged
    by their log-sum-exps. A quantized cache is gathered and dequantized to q's dtype first.
    """
    n = q.shape[0]
    if k_scale is not None and _FLASH is not None:  # checked as gather_kv checks
        nblk = -(-L // k_cache.shape[1])
        if nblk > table.shape[0]:
            raise ValueError("paged_attention: " + ERRORS[2])
        if ((table[:nblk] < 0) | (table[:nblk] >= k_cache.shape[0])).any():
            raise ValueError("paged_attention: " + ERRORS[1])
        k, v = (reference._gather(c, table, nblk, q.dtype, s)[:, :L].transpose(1, 2).contiguous()
                for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
        return _flash_two_pass(q, k, v, L, scale)
    D = q.shape[-1]
    amx = lib.prefill == "amx" and D % 64 == 0  # (AMX's tiles take 64 dims at a time; a CPU with AMX has vdpbf16ps)
    if k_scale is None and lib.prefill and q.dtype == torch.bfloat16 and D % 32 == 0 and D <= 256:
        out = torch.empty_like(q)
        nb, bs, Hkv, _ = k_cache.shape
        table = table.contiguous()
        err = lib.prefill_attention(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    table.data_ptr(), table.shape[0], n, L, q.shape[1], Hkv, D, bs, nb, float(scale),
                                    torch.get_num_threads(), amx)
        if err == 0:
            return out
        if err != UNSUPPORTED:
            raise ValueError(f"paged_attention: {ERRORS.get(err, f'error {err}')}")
    if _FLASH is None:
        return reference.paged_attention(q, k_cache, v_cache, table[None], torch.tensor([0, n], dtype=torch.int32),
                                         torch.tensor([L], dtype=torch.int32), scale, k_scale, v_scale)
    return _flash_two_pass(q, *gather_kv(k_cache, v_cache, table, L, lib), L, scale)


def _flash_two_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    """q's n tokens at positions L-n..L-1 over k, v [1, Hkv, L, D]: the context pass and the causal pass, merged."""
    n = q.shape[0]
    qb = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
    o, lse = _FLASH(qb, k[:, :, L - n :], v[:, :, L - n :], 0.0, True, scale=scale)
    if n < L:
        o_ctx, lse_ctx = _FLASH(qb, k[:, :, : L - n], v[:, :, : L - n], 0.0, False, scale=scale)
        # the chunk's own part weighs e^lse / (e^lse + e^lse_ctx) = sigmoid(lse - lse_ctx)
        o = torch.lerp(o_ctx.float(), o.float(), torch.sigmoid(lse - lse_ctx).unsqueeze(-1)).to(q.dtype)
    return o[0].transpose(0, 1)  # (n, Hq, D)
