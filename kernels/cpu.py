"""Native CPU paged attention (`csrc/paged_attention_cpu.cpp`), built on first use with the system C++ compiler.

The torch twin in `reference.py` gathers every sequence's KV blocks into a fresh tensor per layer and then
runs SDPA; on CPU that copy is most of a decode step. This kernel reads the paged cache in place. Prefill
chunks longer than `MAX_Q_LEN` still go to the twin: CPU SDPA's flash kernel runs them as matmuls, and
the gather is paid once for many queries.

`load(cache_dir)` compiles the source once per (source, flags, compiler, CPU) into `cache_dir`
(concurrent processes wait on a file lock) and loads it; without a compiler, or if the build fails,
it logs why and returns False, and the twin serves.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels import reference

log = logging.getLogger("sluice.kernels")

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-Wall")
MAX_Q_LEN = 16  # longer query runs (prefill chunks) go to the SDPA twin
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ERRORS = {
    1: "a block table entry is outside the KV cache",
    2: "a sequence's query length or context does not fit its block table",
}

_fn = None  # the loaded C entry point


def _cpu_id() -> str:
    """What -march=native compiles for: the .so must not move to a CPU without these instructions."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), "") + platform.machine()
    except OSError:
        return platform.processor() + platform.machine()


def _compile(cxx: str, flags: tuple[str, ...], out: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def build(cache_dir: Path, flags: tuple[str, ...] | None = None, cxx: str | None = None) -> Path:
    """Compiles the kernel once per (source, flags, compiler, CPU) into `cache_dir`; returns the .so path.

    Raises FileNotFoundError without a compiler, CalledProcessError (with the compiler's stderr) on
    a failed build.
    """
    flags = FLAGS if flags is None else flags
    cxx = cxx or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (c++, g++ or $CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join((*flags, version, _cpu_id())).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    so = cache_dir / f"paged_attention_cpu-{key}.so"
    with open(cache_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent process may be compiling the same file
        if not so.is_file():
            log.info("compiling the CPU attention kernel into %s", so)
            _compile(cxx, flags, so)
    return so


def bind(so: Path):
    """The kernel's C entry point from a built library, with its argument types declared."""
    fn = ctypes.CDLL(str(so)).sluice_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64, i64, ptr, ptr, i64,
                   i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def load(cache_dir: Path, cxx: str | None = None) -> bool:
    """Builds (once) and loads the kernel for `paged_attention`; False, with a warning, where impossible."""
    global _fn
    if _fn is not None:
        return True
    try:
        _fn = bind(build(cache_dir, cxx=cxx))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip()[-2000:]
        log.warning("CPU attention kernel unavailable, attention uses the slower torch path: %s", detail)
        return False
    return True


def loaded() -> bool:
    return _fn is not None


def supports(q: torch.Tensor) -> bool:
    return _fn is not None and q.device.type == "cpu" and q.dtype in DTYPES


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, rows may be strided
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    max_q_len: int = MAX_Q_LEN,
    fn=None,  # a `bind()` result (tests); default: the loaded kernel
) -> torch.Tensor:
    """`reference.paged_attention`'s contract; sequences with more than `max_q_len` new tokens go to it."""
    fn = fn or _fn
    if fn is None:
        raise RuntimeError("kernels.cpu.load() has not succeeded")
    T, Hq, D = q.shape
    nb, bs, Hkv, Dk = k_cache.shape
    B = seq_lens.shape[0]
    if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in DTYPES):
        raise TypeError(f"q, k_cache, v_cache must share one of {list(DTYPES)}: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if v_cache.shape != k_cache.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if block_tables.dtype != torch.int32 or cu_seqlens_q.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_tables, cu_seqlens_q and seq_lens must be int32")
    if cu_seqlens_q.shape != (B + 1,) or block_tables.dim() != 2 or block_tables.shape[0] < B:
        raise ValueError("cu_seqlens_q must be [B + 1] and block_tables [>= B, max_blocks] for B = len(seq_lens)")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    cu_seqlens_q, seq_lens = cu_seqlens_q.contiguous(), seq_lens.contiguous()
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or cu[-1] != T or any(a > b for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens_q must rise from 0 to T={T}")
    out = torch.empty_like(q)
    err = fn(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), DTYPES[q.dtype],
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
        cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), B,
        Hq, Hkv, D, bs, nb, float(scale), max_q_len, torch.get_num_threads(),
    )
    if err:
        raise ValueError(f"paged_attention: {ERRORS.get(err, f'error {err}')}")
    long = [b for b in range(B) if cu[b + 1] - cu[b] > max_q_len]
    if long:  # prefill chunks: gather once, then SDPA's flash kernel
        rows = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in long])
        sub_cu = torch.tensor([0] + [cu[b + 1] - cu[b] for b in long], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        idx = torch.tensor(long)
        out[rows] = reference.paged_attention(
            q[rows], k_cache, v_cache, block_tables[idx], sub_cu, seq_lens[idx], scale
        )
    return out
