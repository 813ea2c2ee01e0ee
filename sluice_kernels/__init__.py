"""The kernel ops the model forward calls (docs/architecture.md §8); `_backend` alone picks who serves each call.

The backends share the ops' signatures: `sluice_kernels.triton` (CUDA tensors), `sluice_kernels.cpu` (native C++, once
`cpu.load()` has built it: the engine does, on a CPU device) and `sluice_kernels.reference` (the torch twins).
`SLUICE_KERNELS=auto|triton|torch` (read once, at import) forces one side: `torch` means the twins only;
tests use `triton` with `TRITON_INTERPRET=1` to run the Triton kernels on CPU tensors.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from sluice_kernels import cpu, reference

MODE = os.environ.get("SLUICE_KERNELS", "auto")
if MODE not in ("auto", "triton", "torch"):
    raise ValueError(f"SLUICE_KERNELS must be auto, triton or torch, not {MODE!r}")


def _backend(op: str, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> str:
    """Who runs `op` on tensors of `dtype` on `device` (and a KV cache of `cache_dtype`): "triton", "cpu-native" or
    "torch" (the twin).

    NOTE: reads the module global MODE per call: bench/gpu_check.py flips it to time the twins.
    """
    if MODE == "triton" or (MODE == "auto" and device.type == "cuda"):
        return "triton"
    if MODE == "auto" and device.type == "cpu" and cpu.supports(op, dtype, cache_dtype):
        return "cpu-native"
    return "torch"


def _impl(op: str, t: torch.Tensor, cache_dtype: torch.dtype | None = None) -> Callable:
    """`op` of the backend that serves tensors like `t` (and a KV cache of `cache_dtype`)."""
    backend = _backend(op, t.device, t.dtype, cache_dtype)
    if backend == "triton":
        # imported on first use: CPU-only installs never import triton
        from sluice_kernels import triton

        return getattr(triton, op)
    return getattr(cpu if backend == "cpu-native" else reference, op)


def attention_backend(device: torch.device, dtype: torch.dtype = torch.float32,
                      cache_dtype: torch.dtype | None = None) -> str:
    """Which implementation `paged_attention` uses for `dtype` tensors on `device` and a cache of `cache_dtype`
    (default: `dtype`): triton, cpu-native or torch."""
    return _backend("paged_attention", device, dtype, cache_dtype)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D], the new tokens of all sequences back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the new tokens
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32, for int8 / fp8 caches
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its paged context; one call serves a mixed batch.

    The i-th new token of sequence b (of q_len_b) sits at position `seq_lens[b] - q_len_b + i` and attends
    to the positions up to its own, read through `block_tables[b]`; decodes have q_len 1. GQA: Hq is a
    multiple of Hkv. The caches may hold another dtype than q; a quantized one (`reference.QMAX`) comes with
    its scales, and a cached row reads as `k_cache[...] * k_scale[...]`.
    """
    return _impl("paged_attention", q, k_cache.dtype)(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                                      scale, k_scale, v_scale)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32, for int8 / fp8 caches
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes row t of k and v into the caches at `slot_mapping[t] = block * block_size + offset`; -1 skips it.

    Converted to the caches' dtype; into a quantized one as `reference.quantize` does, its scales into the
    scale tensors at the same slots."""
    _impl("store_kv", k, k_cache.dtype)(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`x / rms(x) * weight`; with a residual, of `x + residual`, returned as `(out, x + residual)`.

    Statistics are fp32; the inputs are not modified.
    """
    return _impl("rms_norm", x)(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int, may stay on the host
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim]: cos (rot_dim/2) then sin (rot_dim/2)
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rot_dim dims of each head of q and k in place and returns (q, k).

    `is_neox`: the two halves pair up; else even dims pair with the following odd dim (GPT-J).
    """
    return _impl("rotary_embedding", q)(positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2d] -> [..., d]
    """The SwiGLU gate: `silu(x[..., :d]) * x[..., d:]`."""
    return _impl("silu_and_mul", x)(x)


__all__ = ["MODE", "attention_backend", "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "store_kv"]
