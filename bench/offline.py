"""offline: a batch of requests with mixed prompt/output lengths, all arriving at once; output tokens/s and MFU.

Systems: Sluice under its three policies, transformers' static `generate` and its continuous batching.
MFU = useful model FLOPs (bench.common.FlopCounter) / wall time / bf16 matmul peak measured in this run.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import matplotlib.pyplot as plt

from bench import report
from bench.common import FlopCounter, Run, matmul_peak_tflops, model_config
from bench.driver import EngineSystem, Req, Trace, measure, summarize
from bench.hf import HFContinuous, HFStatic
from engine import EngineConfig


@dataclass(frozen=True)
class Sizes:
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    max_num_seqs: int
    max_num_batched_tokens: int


# Every request at once (the engine's default max_num_seqs, 256, admits all 64) and the engine's default
# budget; transformers-static then pads one batch of 64, transformers-cb gets the same limits.
FULL = Sizes(64, (32, 512), (32, 256), max_num_seqs=64, max_num_batched_tokens=2048)
QUICK = Sizes(6, (16, 64), (4, 16), max_num_seqs=4, max_num_batched_tokens=128)
WARMUP = Sizes(2, (16, 32), (2, 4), max_num_seqs=4, max_num_batched_tokens=128)


def requests(run: Run, sz: Sizes, tag: str, vocab: int, seed_salt: str = "offline") -> list[Req]:
    rng = run.rng(seed_salt)
    return [
        Req(f"{tag}-{i}", run.tokens(rng, rng.randint(*sz.prompt_len), vocab), rng.randint(*sz.output_len))
        for i in range(sz.num_requests)
    ]


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    limits = {"max_num_seqs": run.max_num_seqs, "max_num_batched_tokens": run.max_num_batched_tokens}
    sz = replace(sz, **{k: v for k, v in limits.items() if v is not None})
    cfg = model_config(run.model_dir)
    vocab = cfg["vocab_size"]
    blocks = sz.max_num_seqs * -(-(sz.prompt_len[1] + sz.output_len[1]) // 16) + 64

    def sluice(policy: str) -> EngineSystem:
        return EngineSystem(f"sluice-{policy}", EngineConfig(
            model=str(run.model_dir), dtype=run.dtype, scheduling=policy, max_num_seqs=sz.max_num_seqs,
            max_num_batched_tokens=sz.max_num_batched_tokens, num_kv_blocks=blocks, seed=run.seed))

    systems = [
        sluice("mixed"), sluice("prefill_first"), sluice("static"),
        HFStatic("transformers-static", run.model_dir, run.torch_dtype, sz.max_num_seqs),
        HFContinuous("transformers-cb", run.model_dir, run.torch_dtype, sz.max_num_seqs, sz.max_num_batched_tokens),
    ]
    peak = matmul_peak_tflops(run.torch_dtype, seconds=0.4 if run.quick else 1.5)
    flops = FlopCounter(cfg)

    def row(s, tr: Trace) -> dict:
        wall = tr.end - tr.start
        useful = sum(flops.request(tr.prompt_len[r], len(ts)) for r, ts in tr.tokens.items())
        return summarize(s.name, tr, mfu=round(useful / wall / (peak * 1e12), 4),
                         model_tflops=round(useful / wall / 1e12, 4))

    rows, _ = measure(
        systems,
        workload=lambda tag: requests(run, sz, tag, vocab, f"offline:{tag}"),
        warmup=lambda tag: requests(run, WARMUP, tag, vocab, "offline-warmup"),
        row=row, rounds=run.rounds, progress=run.progress,
    )
    for s in systems:
        s.close()
    by = {r["system"]: r for r in rows}

    def tok_s(base: str) -> float | None:
        return report.paired_ratio(by["sluice-mixed"], by[base], "throughput_tok_s")

    targets = [
        report.target("sluice-mixed / transformers-static tok/s (same round, median)", tok_s("transformers-static"), ">=", 3.0),
        report.target("sluice-mixed / transformers-cb tok/s (same round, median)", tok_s("transformers-cb"), ">=", 2.0),
    ]

    def plot():
        fig, ax = plt.subplots(figsize=(7, 3.6))
        names = [r["system"] for r in rows]
        vals = [r.get("throughput_tok_s") or 0.0 for r in rows]
        bars = ax.barh(names[::-1], vals[::-1], color=["#4c72b0" if n.startswith("sluice") else "#999999" for n in names[::-1]])
        for b, r in zip(bars, rows[::-1]):
            label = "error" if r.get("error") else f"{r['throughput_tok_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f}%"
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, " " + label, va="center", fontsize=8)
        ax.set_xlabel("output tokens/s (higher is better)")
        ax.set_title(f"offline: {sz.num_requests} requests, prompts {sz.prompt_len[0]}–{sz.prompt_len[1]}, "
                     f"outputs {sz.output_len[0]}–{sz.output_len[1]}", fontsize=9)
        ax.set_xlim(0, max(vals + [1.0]) * 1.45)
        return fig

    report.write(
        run, "offline", rows,
        columns=["throughput_tok_s", "mfu", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
                 "wall_s", "error"],
        config=asdict(sz),
        targets=targets, plot=plot, extra={"peak_tflops": round(peak, 3)},
    )
    return {"rows": rows, "targets": targets}
