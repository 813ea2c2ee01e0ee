"""Kernel tests run the Triton kernels on CPU tensors through the interpreter when there is no GPU.

`TRITON_INTERPRET` must be set before `kernels.triton` (and so `triton.jit`) is first imported;
on a CUDA machine it stays unset and the same tests run the compiled kernels on the GPU.
`SLUICE_KERNELS` is deliberately not set here: `kernels` reads it once at import, and forcing it would
send every later test's engine through the (slow) interpreter. Tests call `kernels.triton` directly.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from engine.config import kernel_cache_dir
from sluice_kernels.cpu.binding import Native, bind
from sluice_kernels.cpu.build import VARIANTS, build, build_variants

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def variant_builds() -> dict[str, Path]:
    """The native CPU kernels the engine builds and, on x86, built without AVX-512 (the AVX2 paths most x86 CPUs run)
    and without AVX2 (the plain C++ loops that other CPUs run); those two compile at once. All three go to the
    engine's kernel cache (`python -m bench attention` builds the same two), so they compile once."""
    paths = {"native": build(kernel_cache_dir())}
    if platform.machine() in ("x86_64", "AMD64"):
        paths |= build_variants(kernel_cache_dir(), list(VARIANTS))
    return paths


@pytest.fixture(scope="session")
def native_builds(variant_builds) -> dict[str, Native]:
    return {name: bind(so) for name, so in variant_builds.items()}
