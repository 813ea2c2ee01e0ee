"""Compiles `csrc/` into one shared library with the system C++ compiler, once per key, into a cache folder.

The key is (sources, flags, compiler, CPU): `-march=native` code must not move to a CPU without its
instructions. Concurrent processes wait on a file lock; a failed build leaves no .so behind. What the compiler
printed is logged as a warning and kept beside the library (`warnings_of`).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("sluice.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_attention_cpu.cpp", CSRC / "prefill_attention_cpu.cpp", CSRC / "elementwise_cpu.cpp")
HEADERS = (CSRC / "cpu_common.h",)
# -Wno-maybe-uninitialized: GCC 12 flags its own _mm512_undefined_ps() inside the AVX-512 intrinsics
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-Wall", "-Wno-maybe-uninitialized")
# x86 builds of the same sources without the best paths, which tests and `python -m bench attention` compare:
# without AVX-512 (the AVX2 loops most x86 CPUs run) and without AVX2 (the plain C++ loops of other CPUs)
VARIANTS = {"no-avx512": "-mno-avx512f", "plain": "-mno-avx2"}


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
        done = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True, text=True)
        warnings_of(out).write_text(done.stderr)
        os.replace(tmp, out)
        if done.stderr.strip():
            log.warning("the C++ compiler warned while building %s:\n%s", out.name, done.stderr.strip())
    except BaseException:
        os.unlink(tmp)
        raise


def warnings_of(so: Path) -> Path:
    """The file beside a built library that keeps what its compiler printed (empty: nothing)."""
    return so.with_suffix(".warnings")


def build(cache_dir: Path, flags: tuple[str, ...] | None = None, cxx: str | None = None) -> Path:
    """Compiles the library once per (sources, flags, compiler, CPU) into `cache_dir`; returns the .so path.

    Raises FileNotFoundError without a compiler, CalledProcessError (with the compiler's stderr) on
    a failed build.
    """
    flags = FLAGS if flags is None else flags
    cxx = cxx or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (c++, g++ or $CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    text = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS, Path(__file__)))  # (this file: how it builds)
    key = hashlib.sha256(text + "\0".join((*flags, version, _cpu_id())).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    so = cache_dir / f"sluice_cpu-{key}.so"
    with open(so.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent process may be compiling the same file
        if not so.is_file():
            log.info("compiling the native CPU kernels into %s", so)
            _compile(cxx, flags, so)
    return so


def build_variants(cache_dir: Path, names: list[str]) -> dict[str, Path]:
    """`build` with each named VARIANTS flag added to FLAGS, compiled at once; their .so paths by name."""
    with ThreadPoolExecutor(max(len(names), 1)) as pool:
        built = {name: pool.submit(build, cache_dir, (*FLAGS, VARIANTS[name])) for name in names}
    return {name: f.result() for name, f in built.items()}
