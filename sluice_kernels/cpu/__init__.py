"""The native CPU backend: `csrc/` compiled on first use (`build.py`), called through ctypes (`binding.py`).

`load(cache_dir)` compiles the sources once per (sources, flags, compiler, CPU) into `cache_dir` and
loads them; without a compiler, or if the build fails, it logs why and returns False, and the twins
serve. The ops have the twins' signatures and contracts, plus `lib=` for tests that pass a build.
"""
from __future__ import annotations

from sluice_kernels.cpu.attention import gather_kv, paged_attention
from sluice_kernels.cpu.binding import Native, load, loaded, prefill, supports
from sluice_kernels.cpu.elementwise import rms_norm, rotary_embedding, silu_and_mul, store_kv

__all__ = ["Native", "gather_kv", "load", "loaded", "paged_attention", "prefill", "rms_norm", "rotary_embedding",
           "silu_and_mul", "store_kv", "supports"]
