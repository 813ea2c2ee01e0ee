"""attention: the CPU paged-attention kernel per build, against its own plain loops and the torch twin.

Decode batches (one new token per sequence over a cached context in a shuffled paged pool) at three attention shapes,
head dim 32 (the test model: 4 query / 2 KV heads), 64 (the `small` model: 8 / 4) and 128 (12 / 2, as Qwen2.5-1.5B),
each at batch 1 x 4,000 tokens, 64 x 500 and 256 x 200, with float32 and bfloat16 caches. Each case runs through:

- `native`: the library the engine loads (`-march=native`: the AVX-512 loops where the CPU has them, else AVX2);
- `no-avx512`, on CPUs with AVX-512 only: the same sources built without it, the AVX2 loops most x86 CPUs run;
- `plain`, on x86 with AVX2: built without AVX2 (`-mno-avx2`), the plain C++ loops other CPUs run: the baseline;
- `twin`: the torch path the engine takes without a compiler (`sluice_kernels/reference.py`: gather the blocks, SDPA).

The builds compile once into the engine's kernel cache. A system's time is its best call over `run.rounds` rounds
(systems in turn within a round) of calls for ~0.2 s each; the ratios divide best by best in the same run. Each row
also gives the largest difference of any build's output from the twin's (float32 math in both).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench import report
from bench.common import Run, cpu_flags
from engine.config import kernel_cache_dir
from sluice_kernels import reference
from sluice_kernels.cpu.attention import paged_attention
from sluice_kernels.cpu.binding import Native, bind
from sluice_kernels.cpu.build import build, build_variants

SHAPES = {32: (4, 2), 64: (8, 4), 128: (12, 2)}  # head dim: (query heads, KV heads)
BLOCK_SIZE = 16  # the engine's default


@dataclass(frozen=True)
class Sizes:
    head_dims: tuple[int, ...]
    batches: tuple[tuple[int, int], ...]  # (sequences, context tokens each)
    dtypes: tuple[str, ...]
    seconds: float  # per system per case per round
    target: tuple[str, int, tuple[int, int]]  # the case of the first target (dtype, head dim, batch)


# the first target's case is a long context at batch 1: the kernel's own loops bound it, not memory
FULL = Sizes((32, 64, 128), ((1, 4000), (64, 500), (256, 200)), ("float32", "bfloat16"), 0.2, ("float32", 64, (1, 4000)))
QUICK = Sizes((32,), ((1, 300), (8, 40)), ("float32", "bfloat16"), 0.02, ("float32", 32, (1, 300)))


def builds() -> dict[str, Native]:
    """The builds this CPU can compare (module docstring), by system name."""
    flags = cpu_flags()
    variants = [name for name, flag in (("no-avx512", "avx512f"), ("plain", "avx2")) if flag in flags]
    paths = {"native": build(kernel_cache_dir()), **build_variants(kernel_cache_dir(), variants)}
    return {name: bind(so) for name, so in paths.items()}


def decode_batch(batch: int, context: int, head_dim: int, dtype: torch.dtype, seed: int) -> tuple:
    """`paged_attention`'s arguments for `batch` decodes over `context` cached tokens each, their blocks shuffled
    over the pool as the block manager leaves them after a while."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = SHAPES[head_dim]
    per = -(-(context + 1) // BLOCK_SIZE)
    pool = batch * per
    k = torch.randn(pool, BLOCK_SIZE, hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(pool, BLOCK_SIZE, hkv, head_dim, generator=g).to(dtype)
    tables = torch.randperm(pool, generator=g).to(torch.int32).view(batch, per)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context + 1, dtype=torch.int32)
    q = torch.randn(batch, hq, head_dim, generator=g).to(dtype)
    return q, k, v, tables, cu, lens, head_dim**-0.5


def best_call(fn, seconds: float) -> float:
    """The fastest of repeated calls of `fn` over ~`seconds` (at least three), in seconds."""
    fn()  # first touch of the pool's pages, OpenMP's threads
    best, deadline, n = float("inf"), time.perf_counter() + seconds, 0
    while n < 3 or time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        best, n = min(best, time.perf_counter() - t), n + 1
    return best


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    libs = builds()
    systems = [*libs, "twin"]
    cases = [(dt, d, b) for dt in sz.dtypes for d in sz.head_dims for b in sz.batches]
    best = {(s, c): float("inf") for s in systems for c in cases}
    rows = []
    for c in cases:
        dt, d, (batch, context) = c
        args = decode_batch(batch, context, d, getattr(torch, dt), run.seed)
        calls = {s: (lambda lib=lib: paged_attention(*args, lib=lib)) for s, lib in libs.items()}
        calls["twin"] = lambda: reference.paged_attention(*args)
        twin = reference.paged_attention(args[0].float(), args[1].float(), args[2].float(), *args[3:]).float()
        err = max((calls[s]().float() - twin).abs().max().item() for s in libs)
        for _ in range(run.rounds):
            for s in systems:
                best[s, c] = min(best[s, c], best_call(calls[s], sz.seconds))
        ms = {s: round(1000 * best[s, c], 3) for s in systems}
        rows.append({"system": f"{dt} D{d} {batch}x{context}", "dtype": dt, "head_dim": d, "heads": "%d/%d" % SHAPES[d],
                     "batch": batch, "context": context, **{f"{s}_ms": ms[s] for s in systems},
                     "native_vs_plain": report.ratio(ms["native"], ms.get("plain")),
                     "native_vs_twin": report.ratio(ms["native"], ms["twin"]), "max_abs_vs_twin": round(err, 6)})
        if run.progress:
            print(f"  attention {rows[-1]['system']}: " + ", ".join(f"{s} {ms[s]} ms" for s in systems), flush=True)
    for r in rows:
        for k in ("native_vs_plain", "native_vs_twin"):
            r[k] = None if r[k] is None else round(r[k], 3)

    dt, d, (b, n) = sz.target
    at = next(r for r in rows if (r["dtype"], r["head_dim"], r["batch"], r["context"]) == (dt, d, b, n))
    targets = [
        # the AVX2 loops measured 0.46x the plain ones on an AVX2-only EPYC when they came in (n/a without AVX2)
        report.target(f"native / plain-loop build, {dt} D{d} {b}x{n} (ms)", at["native_vs_plain"], "<=", 0.6),
        # no gather of the context into a fresh tensor per call
        report.target("native / torch twin, median over every case (ms)",
                      statistics.median(r["native_vs_twin"] for r in rows), "<=", 0.5),
    ]

    def plot():
        import matplotlib.pyplot as plt
        import numpy as np

        fig, ax = plt.subplots(figsize=(max(7, 0.55 * len(rows)), 3.8))
        x, w = np.arange(len(rows)), 0.8 / len(systems)
        colors = {"native": "#4c72b0", "no-avx512": "#55a868", "plain": "#c44e52", "twin": "#999999"}
        for i, s in enumerate(systems):
            ax.bar(x + (i - (len(systems) - 1) / 2) * w, [r[f"{s}_ms"] for r in rows], w, label=s, color=colors[s])
        ax.set_xticks(x, [r["system"] for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms per call (best)")
        ax.set_title(f"CPU paged attention, decode batches, {run.threads} threads", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        return fig

    report.write(run, "attention", rows,
                 columns=["heads", *[f"{s}_ms" for s in systems], "native_vs_plain", "native_vs_twin", "max_abs_vs_twin"],
                 config={**asdict(sz), "block_size": BLOCK_SIZE, "systems": systems}, targets=targets, plot=plot)
    return {"rows": rows, "targets": targets}

