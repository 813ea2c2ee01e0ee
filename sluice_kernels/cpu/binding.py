"""The ctypes binding of the built library (`bind`), and the one library this process loaded (`load`).

No torch headers: the wrappers pass data pointers, sizes and a dtype code; the C functions return 0 or
an error code. Until `load()` succeeds, `supports()` is False everywhere and the torch twins serve.
"""
from __future__ import annotations

import ctypes
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice_kernels.cpu.build import build

log = logging.getLogger("sluice.kernels")

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/cpu_common.h Dtype
QUANTIZED = {torch.int8: 3, torch.float8_e4m3fn: 4}  # cache-only dtypes, with a scale per token and KV head
ERRORS = {
    1: "a block table entry is outside the KV cache",
    2: "a sequence's query length or context does not fit its block table",
}
UNSUPPORTED = 3  # prefill_attention: not in this build or process
PREFILL = {2: "amx", 1: "avx512-bf16", 0: ""}  # sluice_prefill_attention_available(): how bf16 chunks multiply
# fp16 elementwise ops stay on the twins: without a vector fp16 conversion the native loops run scalar.
OP_DTYPES = {"paged_attention": set(DTYPES), "default": {torch.float32, torch.bfloat16}}


@dataclass(frozen=True)
class Native:
    """The C entry points of one built library."""

    paged_attention: ctypes._CFuncPtr
    rms_norm: ctypes._CFuncPtr
    rotary: ctypes._CFuncPtr
    store_kv: ctypes._CFuncPtr
    store_kv_quant: ctypes._CFuncPtr
    silu_and_mul: ctypes._CFuncPtr
    gather_kv: ctypes._CFuncPtr
    prefill_attention: ctypes._CFuncPtr
    # how prefill_attention multiplies: "amx" (built with AMX, and the OS granted the tile state), "avx512-bf16"
    # (vdpbf16ps), or "" (neither: bf16 prefill chunks take SDPA)
    prefill: str


_lib: Native | None = None  # set by load()


def bind(so: Path) -> Native:
    """The library's C entry points, with their argument types declared."""
    lib = ctypes.CDLL(str(so))
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float

    def fn(name: str, *argtypes):
        f = getattr(lib, name)
        f.argtypes, f.restype = list(argtypes), i32
        return f

    return Native(
        paged_attention=fn("sluice_paged_attention", ptr, ptr, ptr, ptr, i32, i32, ptr, ptr, ptr, i64, i64, ptr, ptr,
                           i64, i64, i64, i64, i64, i64, f32, i64, i32),
        rms_norm=fn("sluice_rms_norm", ptr, ptr, ptr, ptr, ptr, i32, i64, i64, f32, i32),
        rotary=fn("sluice_rotary", ptr, ptr, ptr, ptr, i64, i32, i64, i64, i64, i64, i64, i32, i32),
        store_kv=fn("sluice_store_kv", ptr, ptr, ptr, ptr, ptr, i64, i64, i64),
        store_kv_quant=fn("sluice_store_kv_quant", ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32, i64),
        silu_and_mul=fn("sluice_silu_and_mul", ptr, ptr, i32, i64, i64, i32),
        gather_kv=fn("sluice_gather_kv", ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i32),
        prefill_attention=fn("sluice_prefill_attention", ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                             i64, f32, i32, i32),
        prefill=PREFILL[fn("sluice_prefill_attention_available")()],
    )


def load(cache_dir: Path, cxx: str | None = None) -> bool:
    """Builds (once) and loads the kernels the dispatcher uses; False, with a warning, where impossible."""
    global _lib
    if _lib is not None:
        return True
    try:
        _lib = bind(build(cache_dir, cxx=cxx))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip()[-2000:]
        log.warning("native CPU kernels unavailable, the slower torch path serves: %s", detail)
        return False
    log.info("native CPU kernels loaded; bf16 prefill chunks run on %s",
             {"amx": "AMX tiles", "avx512-bf16": "AVX512-BF16"}.get(_lib.prefill, "SDPA"))
    return True


def loaded() -> bool:
    return _lib is not None


def prefill() -> str:
    """How bf16 prefill chunks run in this process: "amx", "avx512-bf16" (the native kernel, `Native.prefill`) or
    "" (SDPA)."""
    return "" if _lib is None else _lib.prefill


def supports(op: str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the loaded library serves `op` on CPU tensors of `dtype` (the dispatcher asks per call), with a KV
    cache of `cache_dtype` for the ops that take one: `dtype` itself or a quantized one."""
    if cache_dtype not in (None, dtype) and cache_dtype not in QUANTIZED:
        return False
    return _lib is not None and dtype in OP_DTYPES.get(op, OP_DTYPES["default"])


def need(lib: Native | None) -> Native:
    """`lib` if given (tests pass a build of their own), else the loaded library."""
    lib = lib or _lib
    if lib is None:
        raise RuntimeError("kernels.cpu.load() has not succeeded")
    return lib
