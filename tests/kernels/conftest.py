"""Kernel tests run the Triton kernels on CPU tensors through the interpreter when there is no GPU.

`TRITON_INTERPRET` must be set before `kernels.triton` (and so `triton.jit`) is first imported;
on a CUDA machine it stays unset and the same tests run the compiled kernels on the GPU.
`SLUICE_KERNELS` is deliberately not set here: `kernels` reads it once at import, and forcing it would
send every later test's engine through the (slow) interpreter. Tests call `kernels.triton` directly.
"""
from __future__ import annotations

import os
import platform
from concurrent.futures import ThreadPoolExecutor

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
    (the AVX2 paths most x86 CPUs run) and without AVX2 (the plain C++ loops that other CPUs run); those two
    compile at once."""
    libs = {"native": bind(build(kernel_cache_dir()))}
    if platform.machine() in ("x86_64", "AMD64"):
        variants = {"no-avx512": "-mno-avx512f", "plain": "-mno-avx2"}
        with ThreadPoolExecutor(len(variants)) as pool:
            built = {name: pool.submit(build, tmp_path_factory.mktemp("kernels"), (*FLAGS, flag))
                     for name, flag in variants.items()}
        libs |= {name: bind(f.result()) for name, f in built.items()}
    return libs
