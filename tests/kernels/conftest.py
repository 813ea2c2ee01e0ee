"""Kernel tests run the Triton kernels on CPU tensors through the interpreter when there is no GPU.

`TRITON_INTERPRET` must be set before `kernels.triton` (and so `triton.jit`) is first imported;
on a CUDA machine it stays unset and the same tests run the compiled kernels on the GPU.
`SLUICE_KERNELS` is deliberately not set here: `kernels` reads it once at import, and forcing it would
send every later test's engine through the (slow) interpreter. Tests call `kernels.triton` directly.
"""
from __future__ import annotations

import logging
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


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="session")
def variant_builds(tmp_path_factory) -> tuple[dict[str, Native], list[str]]:
    """The native CPU kernels the engine builds (the same library, from its cache) and, on x86, built without AVX-512
    (the AVX2 paths most x86 CPUs run) and without AVX2 (the plain C++ loops that other CPUs run); those two
    compile at once, here, and the warnings their compiler printed come with them."""
    libs = {"native": bind(build(kernel_cache_dir()))}
    warned = _Records()
    if platform.machine() in ("x86_64", "AMD64"):
        variants = {"no-avx512": "-mno-avx512f", "plain": "-mno-avx2"}
        logging.getLogger("sluice.kernels").addHandler(warned)
        try:
            with ThreadPoolExecutor(len(variants)) as pool:
                built = {name: pool.submit(build, tmp_path_factory.mktemp("kernels"), (*FLAGS, flag))
                         for name, flag in variants.items()}
            libs |= {name: bind(f.result()) for name, f in built.items()}
        finally:
            logging.getLogger("sluice.kernels").removeHandler(warned)
    return libs, [r.getMessage() for r in warned.records]


@pytest.fixture(scope="session")
def native_builds(variant_builds) -> dict[str, Native]:
    return variant_builds[0]
