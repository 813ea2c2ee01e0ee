"""The native CPU paged attention (`sluice_kernels/cpu/attention.py`, `csrc/paged_attention_cpu.cpp`) equals the torch twin.

Every native build is checked: the default one (`-march=native`: the AVX-512 path on CPUs that have it, for head
dims 32, 64 and 128), one compiled without AVX-512 (the AVX2 path for those dims) and one without AVX2, which takes
the plain C++ loops everywhere.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sluice_kernels import reference
from sluice_kernels.cpu import attention
from sluice_kernels.cpu.binding import Native, bind
from tests.kernels.common import DTYPES, TOLERANCES, PagedBatch, paged_batch

MIXED = ([1, 7, 1, 12, 1, 40, 0], [30, 9, 0, 0, 16, 25, 5])  # decodes, chunks, a whole prompt, an idle row


def _cpu(batch: PagedBatch) -> PagedBatch:
    return PagedBatch(*(t.cpu() for t in batch.args()))


def _check(lib, batch: PagedBatch, scale: float = 0.3, **kw) -> None:
    out = attention.paged_attention(*batch.args(), scale, lib=lib, **kw)
    ref = reference.paged_attention(*batch.args(), scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[batch.q.dtype])


@pytest.mark.parametrize("build", ["native", "no-avx512", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_equals_the_twin(native_builds, build, dtype, head_dim):
    if build not in native_builds:
        pytest.skip("x86-only build variant")
    batch = _cpu(paged_batch(*MIXED, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype))
    _check(native_builds[build], batch)  # the 40-token prompt goes to the twin (MAX_Q_LEN)
    _check(native_builds[build], batch, max_q_len=1 << 30)  # every row through the native kernel, causal mask included


@pytest.mark.parametrize("block_size", [8, 16, 32, 48])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1), (6, 3)], ids=["gqa1", "gqa4", "gqa8", "gqa2-odd"])
def test_block_sizes_and_gqa(native_builds, block_size, heads):
    hq, hkv = heads
    batch = _cpu(paged_batch(*MIXED, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=block_size))
    for lib in native_builds.values():
        _check(lib, batch, max_q_len=1 << 30)


@pytest.mark.parametrize("num_seqs", [1, 3, 40])
def test_work_split_over_heads_and_long_contexts(native_builds, num_seqs):
    """Few sequences split their KV heads over the threads; a 1,500-token context spans many blocks."""
    lens = [1500] + [37 * (b + 1) for b in range(num_seqs - 1)]
    batch = _cpu(paged_batch([1] * num_seqs, lens, num_q_heads=8, num_kv_heads=4, head_dim=64, block_size=16))
    for lib in native_builds.values():
        _check(lib, batch)


def test_block_tables_may_be_a_strided_view(native_builds):
    """The model runner passes `block_tables[:B, :max_blocks]` of a wider buffer."""
    b = _cpu(paged_batch(*MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8))
    wide = torch.full((b.block_tables.shape[0] + 2, b.block_tables.shape[1] + 5), -7, dtype=torch.int32)
    wide[: b.block_tables.shape[0], : b.block_tables.shape[1]] = b.block_tables
    view = wide[: b.block_tables.shape[0], : b.block_tables.shape[1]]
    assert not view.is_contiguous()
    out = attention.paged_attention(b.q, b.k_cache, b.v_cache, view, b.cu_seqlens_q, b.seq_lens, 0.3, lib=native_builds["native"])
    torch.testing.assert_close(out, reference.paged_attention(*b.args(), 0.3), **TOLERANCES[torch.float32])


def test_bad_input_is_refused_not_read(native_builds):
    lib = native_builds["native"]
    b = _cpu(paged_batch([1, 1], [20, 5], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8))
    bad = b.block_tables.clone()
    bad[0, 1] = b.k_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="outside the KV cache"):
        attention.paged_attention(b.q, b.k_cache, b.v_cache, bad, b.cu_seqlens_q, b.seq_lens, 0.3, lib=lib)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="outside the KV cache"):
        attention.paged_attention(b.q, b.k_cache, b.v_cache, bad, b.cu_seqlens_q, b.seq_lens, 0.3, lib=lib)
    long = b.seq_lens.clone()
    long[1] = 8 * b.block_tables.shape[1] + 1  # more context than the table can hold
    with pytest.raises(ValueError, match="does not fit"):
        attention.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, long, 0.3, lib=lib)
    b20 = _cpu(paged_batch([20], [4], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8))
    short = b20.seq_lens - 5  # a 20-token chunk in a 19-token context, on the SDPA path (over MAX_Q_LEN)
    with pytest.raises(ValueError, match="does not fit"):
        attention.paged_attention(b20.q, b20.k_cache, b20.v_cache, b20.block_tables, b20.cu_seqlens_q, short, 0.3, lib=lib)
    with pytest.raises(TypeError, match="int32"):
        attention.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables.long(), b.cu_seqlens_q, b.seq_lens, 0.3, lib=lib)
    with pytest.raises(TypeError, match="q.s dtype"):
        attention.paged_attention(b.q.bfloat16(), b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens, 0.3, lib=lib)
    with pytest.raises(ValueError, match="rise"):
        attention.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.cu_seqlens_q.flip(0), b.seq_lens, 0.3, lib=lib)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_kv_is_the_twins_gather_head_major(native_builds, dtype):
    b = _cpu(paged_batch([1], [45], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=dtype))
    table, L = b.block_tables[0], int(b.seq_lens[0])
    k, v = attention.gather_kv(b.k_cache, b.v_cache, table, L, lib=native_builds["native"])
    nb = -(-L // 8)
    assert torch.equal(k, reference._gather(b.k_cache, table, nb, dtype)[:, :L].transpose(1, 2))
    assert torch.equal(v, reference._gather(b.v_cache, table, nb, dtype)[:, :L].transpose(1, 2))
    bad = table.clone()
    bad[2] = b.k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the KV cache"):
        attention.gather_kv(b.k_cache, b.v_cache, bad, L, lib=native_builds["native"])
    with pytest.raises(ValueError, match="needs more blocks"):
        attention.gather_kv(b.k_cache, b.v_cache, table, 8 * table.shape[0] + 1, lib=native_builds["native"])


# -- prefill chunks in one native pass (csrc/prefill_attention_cpu.cpp): AMX tiles, or vdpbf16ps ---------------

CHUNKS = [(17, 0), (40, 9), (64, 1), (100, 300), (240, 1800), (300, 0)]  # (new tokens, cached before them)
PREFILL = ["amx", "avx512-bf16"]


def _prefill(native_builds, kind: str) -> Native:
    """The default build, its prefill kernel set to `kind`; skips where this CPU has not got it (a CPU with AMX
    has AVX512-BF16 too, so both run there)."""
    lib = native_builds["native"]
    if lib.prefill == "" or (kind == "amx" and lib.prefill != "amx"):
        pytest.skip(f"this CPU (or kernel) cannot run {kind}: prefill chunks take the SDPA path, tested above")
    return dataclasses.replace(lib, prefill=kind)


def _no_sdpa(monkeypatch) -> None:
    """The native kernel reads the paged cache itself: the SDPA path's gather must not run."""
    def refuse(*args, **kwargs):
        raise AssertionError("the SDPA path ran")
    monkeypatch.setattr(attention, "gather_kv", refuse)


@pytest.mark.parametrize("kind", PREFILL)
@pytest.mark.parametrize("n,cached", CHUNKS, ids=[f"{n}on{c}" for n, c in CHUNKS])
@pytest.mark.parametrize("heads,head_dim", [((8, 4), 64), ((8, 1), 128), ((6, 3), 64), ((4, 4), 256), ((4, 2), 32)],
                         ids=["gqa2-d64", "gqa8-d128", "gqa2-odd-d64", "mha-d256", "gqa2-d32"])
@pytest.mark.parametrize("block_size", [16, 24])
def test_prefill_chunks_in_one_pass_equal_the_twin(native_builds, monkeypatch, kind, n, cached, heads, head_dim,
                                                   block_size):
    """Whole prompts (cached = 0: the first query sees one key) and chunks over short and long contexts,
    next to decodes; 24-token blocks put a block boundary inside the 16-key tiles. A head dim of 32 takes
    vdpbf16ps on a CPU with AMX too (AMX's tiles take 64 dims at a time)."""
    lib = _prefill(native_builds, kind)
    _no_sdpa(monkeypatch)
    b = _cpu(paged_batch([1, n, 3], [50, cached, 7], num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                         block_size=block_size, dtype=torch.bfloat16))
    _check(lib, b)


@pytest.mark.parametrize("kind", PREFILL)
def test_one_pass_agrees_with_the_sdpa_path_it_replaces(native_builds, kind):
    lib = _prefill(native_builds, kind)
    b = _cpu(paged_batch([240, 1], [1000, 30], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                         dtype=torch.bfloat16))
    one = attention.paged_attention(*b.args(), 0.125, lib=lib)
    sdpa = attention.paged_attention(*b.args(), 0.125, lib=dataclasses.replace(lib, prefill=""))
    torch.testing.assert_close(one, sdpa, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", PREFILL)
def test_one_pass_refuses_a_bad_block_before_reading(native_builds, monkeypatch, kind):
    lib = _prefill(native_builds, kind)
    _no_sdpa(monkeypatch)
    b = _cpu(paged_batch([40], [30], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16))
    for block in (b.k_cache.shape[0], -1):
        bad = b.block_tables.clone()
        bad[0, 2] = block
        with pytest.raises(ValueError, match="outside the KV cache"):
            attention.paged_attention(b.q, b.k_cache, b.v_cache, bad, b.cu_seqlens_q, b.seq_lens, 0.3, lib=lib)


@pytest.fixture(scope="module")
def amx_emulated(native_builds, tmp_path_factory) -> Native:
    """The default build with `amx_emulated.cpp` for `prefill_attention_cpu.cpp`: the `Amx` path on emulated tiles."""
    import shutil
    import subprocess
    from pathlib import Path

    from sluice_kernels.cpu import build

    cxx = shutil.which("c++") or shutil.which("g++")
    if native_builds["native"].prefill == "" or cxx is None:
        pytest.skip("the emulated AMX build needs AVX512-BF16 and a C++ compiler")
    out = tmp_path_factory.mktemp("amx-emulated") / "emulated.so"
    sources = [Path(__file__).with_name("amx_emulated.cpp"),
               *(f for f in build.SOURCES if f.name != "prefill_attention_cpu.cpp")]
    subprocess.run([cxx, *build.FLAGS, "-w", "-D__AMX_TILE__", "-D__AMX_BF16__", f"-I{build.CSRC}", *map(str, sources),
                    "-o", str(out)], check=True, capture_output=True)
    lib = bind(out)
    assert lib.prefill == "amx"
    return lib


@pytest.mark.parametrize("n,cached", CHUNKS, ids=[f"{n}on{c}" for n, c in CHUNKS])
@pytest.mark.parametrize("heads,head_dim", [((8, 4), 64), ((6, 3), 128), ((4, 4), 256), ((4, 2), 32)])
def test_the_amx_path_on_emulated_tiles_equals_the_twin(amx_emulated, monkeypatch, n, cached, heads, head_dim):
    """What `Amx` adds to the shared pass (its tile loads, strides and multiplies) is checked on every CPU with
    AVX512-BF16, AMX or not; on a CPU with AMX the tests above run the same code on real tiles. (A head dim of 32
    takes vdpbf16ps there: AMX's tiles take 64 dims at a time.)"""
    _no_sdpa(monkeypatch)
    b = _cpu(paged_batch([1, n, 3], [50, cached, 7], num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                         block_size=24, dtype=torch.bfloat16))
    _check(amx_emulated, b)


def test_builds_without_avx512_keep_the_sdpa_path(native_builds):
    if "no-avx512" not in native_builds:
        pytest.skip("x86-only build variant")
    assert native_builds["no-avx512"].prefill == ""
