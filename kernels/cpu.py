"""Native CPU kernels (`csrc/`), built on first use with the system C++ compiler and called through ctypes.

- `paged_attention` reads the paged KV cache in place. The torch twin in `reference.py` gathers every
  sequence's KV blocks into a fresh tensor per layer and then runs SDPA; on CPU that copy was most of a
  decode step. Prefill chunks longer than `MAX_Q_LEN` go, in bf16 on CPUs with AMX, to
  `csrc/prefill_attention_amx.cpp` (one pass over the paged context in tile matmuls); elsewhere they
  gather and take CPU SDPA's flash kernel, twice (context, then the chunk itself, causal) and merged.
- `rms_norm`, `rotary_embedding`, `store_kv`, `silu_and_mul`: each one pass over its rows instead of
  4-25 small torch ops (a decode step of a small batch is mostly op dispatch otherwise).

Same signatures and contracts as the twins (docs/architecture.md §8). `load(cache_dir)` compiles the sources once per
(sources, flags, compiler, CPU) into `cache_dir` (concurrent processes wait on a file lock) and loads them;
without a compiler, or if the build fails, it logs why and returns False, and the twins serve.
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
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import reference

log = logging.getLogger("sluice.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_attention_cpu.cpp", CSRC / "prefill_attention_amx.cpp", CSRC / "elementwise_cpu.cpp")
HEADERS = (CSRC / "cpu_common.h",)
# -Wno-maybe-uninitialized: GCC 12 flags its own _mm512_undefined_ps() inside the AVX-512 intrinsics
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-Wall", "-Wno-maybe-uninitialized")
MAX_Q_LEN = 16  # longer query runs (prefill chunks) go to the SDPA twin
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/cpu_common.h Dtype
ERRORS = {
    1: "a block table entry is outside the KV cache",
    2: "a sequence's query length or context does not fit its block table",
}
UNSUPPORTED = 3  # prefill_attention: no AMX in this build or process


@dataclass(frozen=True)
class Native:
    """The C entry points of one built library."""

    paged_attention: ctypes._CFuncPtr
    rms_norm: ctypes._CFuncPtr
    rotary: ctypes._CFuncPtr
    store_kv: ctypes._CFuncPtr
    silu_and_mul: ctypes._CFuncPtr
    gather_kv: ctypes._CFuncPtr
    prefill_attention: ctypes._CFuncPtr
    amx: bool  # prefill_attention can run: built with AMX, and the OS granted the tile state


_lib: Native | None = None  # set by load()


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
        subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


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
    text = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + "\0".join((*flags, version, _cpu_id())).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    so = cache_dir / f"sluice_cpu-{key}.so"
    with open(cache_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent process may be compiling the same file
        if not so.is_file():
            log.info("compiling the native CPU kernels into %s", so)
            _compile(cxx, flags, so)
    return so


def bind(so: Path) -> Native:
    """The library's C entry points, with their argument types declared."""
    lib = ctypes.CDLL(str(so))
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float

    def fn(name: str, *argtypes):
        f = getattr(lib, name)
        f.argtypes, f.restype = list(argtypes), i32
        return f

    return Native(
        paged_attention=fn("sluice_paged_attention", ptr, ptr, ptr, ptr, i32, ptr, i64, i64, ptr, ptr, i64,
                           i64, i64, i64, i64, i64, f32, i64, i32),
        rms_norm=fn("sluice_rms_norm", ptr, ptr, ptr, ptr, ptr, i32, i64, i64, f32, i32),
        rotary=fn("sluice_rotary", ptr, ptr, ptr, ptr, i64, i32, i64, i64, i64, i64, i64, i32, i32),
        store_kv=fn("sluice_store_kv", ptr, ptr, ptr, ptr, ptr, i64, i64, i64),
        silu_and_mul=fn("sluice_silu_and_mul", ptr, ptr, i32, i64, i64, i32),
        gather_kv=fn("sluice_gather_kv", ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i32),
        prefill_attention=fn("sluice_prefill_attention", ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                             i64, f32, i32),
        amx=bool(fn("sluice_prefill_attention_available")()),
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
    log.info("native CPU kernels loaded; bf16 prefill chunks run on %s", "AMX tiles" if _lib.amx else "SDPA (no AMX)")
    return True


def loaded() -> bool:
    return _lib is not None


def amx() -> bool:
    """Whether bf16 prefill chunks run on the AMX kernel in this process (built with AMX, tiles granted)."""
    return _lib is not None and _lib.amx


# fp16 elementwise ops stay on the twins: without a vector fp16 conversion the native loops run scalar.
OP_DTYPES = {"paged_attention": set(DTYPES), "default": {torch.float32, torch.bfloat16}}


def supports(op: str, t: torch.Tensor) -> bool:
    """Whether the loaded library serves `op` for tensors like `t` (the dispatcher asks per call)."""
    return _lib is not None and t.device.type == "cpu" and t.dtype in OP_DTYPES.get(op, OP_DTYPES["default"])


def _need(lib: Native | None) -> Native:
    lib = lib or _lib
    if lib is None:
        raise RuntimeError("kernels.cpu.load() has not succeeded")
    return lib


def _threads() -> int:
    return torch.get_num_threads()


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
    lib: Native | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    lib = _need(lib)
    if (x.dim() != 2 or weight.shape != x.shape[-1:] or weight.dtype != x.dtype
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
        return reference.rms_norm(x, weight, eps, residual)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    res_out = None if residual is None else torch.empty_like(x)
    res_in = None if residual is None else residual.contiguous()
    lib.rms_norm(out.data_ptr(), x.data_ptr(), None if res_in is None else res_in.data_ptr(),
                 None if res_out is None else res_out.data_ptr(), weight.data_ptr(), DTYPES[x.dtype],
                 x.shape[0], x.shape[1], float(eps), _threads())
    return out if residual is None else (out, res_out)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32
    is_neox: bool = True,
    lib: Native | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (they must be contiguous, else the twin serves) and returns them."""
    lib = _need(lib)
    T, Hq, D = q.shape
    rot = cos_sin_cache.shape[-1]
    if (not (q.is_contiguous() and k.is_contiguous()) or k.dtype != q.dtype or k.shape[0] != T or k.shape[2] != D
            or cos_sin_cache.dtype != torch.float32 or rot > D or rot % 2 or positions.device.type != "cpu"):
        return reference.rotary_embedding(positions, q, k, cos_sin_cache, is_neox)
    pos = positions.to(torch.int64).contiguous()
    cs = cos_sin_cache.contiguous()
    if pos.shape != (T,):
        raise ValueError(f"positions must be [T={T}], got {tuple(positions.shape)}")
    if lib.rotary(pos.data_ptr(), q.data_ptr(), k.data_ptr(), cs.data_ptr(), cs.shape[0], DTYPES[q.dtype],
                  T, Hq, k.shape[1], D, rot, int(is_neox), _threads()):
        raise IndexError(f"a position is outside the rotary cache of {cs.shape[0]} positions")
    return q, k


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 skips
    lib: Native | None = None,
) -> None:
    lib = _need(lib)
    T = k.shape[0]
    row = k.shape[1:]
    if (k.dtype != k_cache.dtype or v.dtype != k.dtype or v_cache.dtype != k.dtype or v.shape != k.shape
            or k_cache.shape != v_cache.shape or k_cache.shape[2:] != row
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
    k, v = k.contiguous(), v.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (T,):
        raise ValueError(f"slot_mapping must be [T={T}], got {tuple(slot_mapping.shape)}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if lib.store_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), T,
                    k[0].numel() * k.element_size() if T else 0, num_slots):
        raise IndexError(f"a slot is outside the KV cache of {num_slots} slots")


def silu_and_mul(x: torch.Tensor, lib: Native | None = None) -> torch.Tensor:  # [..., 2d] -> [..., d]
    lib = _need(lib)
    if x.shape[-1] % 2:  # the halves differ in size: the twin raises the shape error
        return reference.silu_and_mul(x)
    d = x.shape[-1] // 2
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    lib.silu_and_mul(out.data_ptr(), x.data_ptr(), DTYPES[x.dtype], out.numel() // d if d else 0, d, _threads())
    return out


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, rows may be strided
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    max_q_len: int = MAX_Q_LEN,
    lib: Native | None = None,
) -> torch.Tensor:
    """`reference.paged_attention`'s contract; sequences with more than `max_q_len` new tokens go to it."""
    lib = _need(lib)
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
    err = lib.paged_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), DTYPES[q.dtype],
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
        cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), B,
        Hq, Hkv, D, bs, nb, float(scale), max_q_len, torch.get_num_threads(),
    )
    if err:
        raise ValueError(f"paged_attention: {ERRORS.get(err, f'error {err}')}")
    for b in range(B):  # prefill chunks: gather once, then SDPA's flash kernel
        n, L = cu[b + 1] - cu[b], int(seq_lens[b])
        if n > max_q_len:
            if n > L:  # as the native kernel checks the shorter ones
                raise ValueError(f"paged_attention: {ERRORS[2]}")
            out[cu[b] : cu[b + 1]] = _prefill_attention(q[cu[b] : cu[b + 1]], k_cache, v_cache, block_tables[b],
                                                        L, scale, lib)
    return out


def _flash_op():
    try:  # (output, logsumexp); torch's CPU flash kernel, which `scaled_dot_product_attention` calls
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


_FLASH = _flash_op()


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, L: int,
              lib: Native | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first L tokens of a sequence's K and V, head-major: two [1, Hkv, L, D] tensors."""
    lib = _need(lib)
    nb, bs, Hkv, D = k_cache.shape
    if table.dtype != torch.int32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise TypeError("gather_kv: the block table must be int32 and the caches contiguous")
    if -(-L // bs) > table.shape[0]:
        raise ValueError(f"a context of {L} tokens needs more blocks than the table's {table.shape[0]}")
    k = torch.empty(1, Hkv, L, D, dtype=k_cache.dtype)
    v = torch.empty_like(k)
    table = table.contiguous()
    if lib.gather_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), L, bs,
                     Hkv, D, k_cache.element_size(), nb, _threads()):
        raise ValueError("paged_attention: " + ERRORS[1])
    return k, v


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                       L: int, scale: float, lib: Native) -> torch.Tensor:
    """n new tokens at positions L-n..L-1 of one sequence -> [n, Hq, D].

    bf16 with AMX and a head dim that is a multiple of 64 (up to 256): the native AMX kernel, one pass.
    Otherwise SDPA's flash kernel; its causal mask is aligned top-left, a chunk's is bottom-right, so
    instead of an n x L mask (built per layer, and no masked tile skipped) this runs two flash passes:
    the chunk over its cached context (no mask) and over itself (causal, which is then aligned), merged
    by their log-sum-exps.
    """
    n = q.shape[0]
    if lib.amx and q.dtype == torch.bfloat16 and q.shape[-1] % 64 == 0 and q.shape[-1] <= 256:
        out = torch.empty_like(q)
        nb, bs, Hkv, D = k_cache.shape
        table = table.contiguous()
        err = lib.prefill_attention(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    table.data_ptr(), table.shape[0], n, L, q.shape[1], Hkv, D, bs, nb, float(scale),
                                    _threads())
        if err == 0:
            return out
        if err != UNSUPPORTED:
            raise ValueError(f"paged_attention: {ERRORS.get(err, f'error {err}')}")
    if _FLASH is None:
        return reference.paged_attention(q, k_cache, v_cache, table[None], torch.tensor([0, n], dtype=torch.int32),
                                         torch.tensor([L], dtype=torch.int32), scale)
    k, v = gather_kv(k_cache, v_cache, table, L, lib)  # (1, Hkv, L, D)
    qb = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
    o, lse = _FLASH(qb, k[:, :, L - n :], v[:, :, L - n :], 0.0, True, scale=scale)
    if n < L:
        o_ctx, lse_ctx = _FLASH(qb, k[:, :, : L - n], v[:, :, : L - n], 0.0, False, scale=scale)
        # the chunk's own part weighs e^lse / (e^lse + e^lse_ctx) = sigmoid(lse - lse_ctx)
        o = torch.lerp(o_ctx.float(), o.float(), torch.sigmoid(lse - lse_ctx).unsqueeze(-1)).to(q.dtype)
    return o[0].transpose(0, 1)  # (n, Hq, D)
