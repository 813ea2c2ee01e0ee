"""Kernel ops used by the model forward (docs/architecture.md §8), dispatched per call.

Triton kernels serve CUDA tensors. CPU tensors get the native kernels of `cpu.py` once `cpu.load()`
has built them (the engine does, on a CPU device), else the torch twins in `reference.py`.
`SLUICE_KERNELS=triton|torch|auto` (read once, at import) forces one side: `torch` means the twins
only; tests use `triton` with `TRITON_INTERPRET=1` to run the Triton kernels on CPU tensors.
"""
from __future__ import annotations

import os

import torch

from kernels import cpu, reference

MODE = os.environ.get("SLUICE_KERNELS", "auto")
if MODE not in ("auto", "triton", "torch"):
    raise ValueError(f"SLUICE_KERNELS must be auto, triton or torch, not {MODE!r}")

_triton = None


def _triton_ops():
    global _triton
    if _triton is None:
        # imports triton lazily: CPU-only installs never pay for it
        from kernels import triton_ops

        _triton = triton_ops
    return _triton


def _use_triton(t: torch.Tensor) -> bool:
    if MODE == "torch":
        return False
    if MODE == "triton":
        return True
    return t.is_cuda


def _dispatch(name: str, device_arg: int = 0):
    """`device_arg`: the positional argument whose device picks the implementation."""
    ref = getattr(reference, name)
    native = getattr(cpu, name, None) if MODE == "auto" else None

    def op(*args, **kwargs):
        t = args[device_arg]
        if _use_triton(t):
            impl = getattr(_triton_ops(), name)
        elif native is not None and cpu.supports(name, t):
            impl = native
        else:
            impl = ref
        return impl(*args, **kwargs)

    op.__name__ = name
    op.__doc__ = ref.__doc__
    return op


def attention_backend(device: torch.device) -> str:
    """Which implementation `paged_attention` uses for tensors on `device`: triton, cpu-native or torch."""
    if MODE == "triton" or (MODE == "auto" and device.type == "cuda"):
        return "triton"
    return "cpu-native" if MODE == "auto" and cpu.loaded() else "torch"


paged_attention = _dispatch("paged_attention")
store_kv = _dispatch("store_kv")
rms_norm = _dispatch("rms_norm")
rotary_embedding = _dispatch("rotary_embedding", device_arg=1)  # positions may stay on the host
silu_and_mul = _dispatch("silu_and_mul")

__all__ = ["MODE", "attention_backend", "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "store_kv"]
