"""The Triton side of the dispatch in `kernels/__init__.py`: the five ops of docs/architecture.md §8.

Each lives in its own kernel file (kernel + asserting launcher); signatures match `reference.py`.
"""
from __future__ import annotations

from kernels.activation import silu_and_mul
from kernels.attention import paged_attention
from kernels.cache import store_kv
from kernels.norm import rms_norm
from kernels.rotary import rotary_embedding

__all__ = ["paged_attention", "store_kv", "rms_norm", "rotary_embedding", "silu_and_mul"]
