"""The Triton backend: one file per op family, each a `@triton.jit` kernel and a launcher that asserts
shapes, dtypes and strides. Serves CUDA tensors, and CPU tensors under `TRITON_INTERPRET=1` (the tests).

Importing this package imports triton: `kernels/__init__.py` does so on first use only.
"""
from __future__ import annotations

from kernels.triton.activation import silu_and_mul
from kernels.triton.attention import paged_attention
from kernels.triton.cache import store_kv
from kernels.triton.norm import rms_norm
from kernels.triton.rotary import rotary_embedding

__all__ = ["paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "store_kv"]
