"""The Triton backend: one file per op family, each a `@triton.jit` kernel and a launcher that asserts
shapes, dtypes and strides. Serves CUDA tensors, and CPU tensors under `TRITON_INTERPRET=1` (the tests).

Importing this package imports triton: `sluice_kernels/__init__.py` does so on first use only.
"""
from __future__ import annotations

from sluice_kernels.triton.activation import silu_and_mul
from sluice_kernels.triton.attention import paged_attention
from sluice_kernels.triton.cache import store_kv
from sluice_kernels.triton.norm import rms_norm
from sluice_kernels.triton.rotary import rotary_embedding

__all__ = ["paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "store_kv"]
