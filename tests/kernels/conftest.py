"""Kernel tests run the Triton kernels on CPU tensors through the interpreter when there is no GPU.

`TRITON_INTERPRET` must be set before `kernels.triton` (and so `triton.jit`) is first imported;
on a CUDA machine it stays unset and the same tests run the compiled kernels on the GPU.
`SLUICE_KERNELS` is deliberately not set here: `kernels` reads it once at import, and forcing it would
send every later test's engine through the (slow) interpreter. Tests call `kernels.triton` directly.
"""
from __future__ import annotations

import os
import platform

import pytest
import torch

from engine.config import kernel_cache_dir
from kernels.cpu.binding import Native, bind
from kernels.cpu.build import FLAGS, build

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def native_builds(tmp_path_factory) -> dict[str, Native]:
    """The native CPU kernels the engine builds (the same library, from its cache) and, on x86, built without AVX-512
    (the plain C++ loops that other CPUs run)."""
    libs = {"native": bind(build(kernel_cache_dir()))}
    if platform.machine() in ("x86_64", "AMD64"):
        libs["no-avx512"] = bind(build(tmp_path_factory.mktemp("kernels"), (*FLAGS, "-mno-avx512f")))
    return libs
