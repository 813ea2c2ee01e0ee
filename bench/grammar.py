"""grammar: free streams decode beside one request held to a grammar that is slow to follow; do its masks stall them?

The structured request's regex, `(\\w+\\s?){1,50}`, makes xgrammar weigh many ways to split the text, and each of its
token masks takes tens to hundreds of milliseconds at a vocabulary of thousands. Systems: `masks-off-step` (the
engine: once a mask was slow, the request's next ones are made on a thread of their own and it waits for them,
engine/structured.py) and `masks-in-step` (every mask made in the step, as before: `SLOW_MASK_S` infinite). The ITL
metrics are the free streams'; `grammar_tokens_s` is the structured request's own speed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import matplotlib.pyplot as plt

from bench import report
from bench.common import Run, model_config
from bench.driver import EngineSystem, Req, Trace, measure, summarize
from engine import EngineConfig, SamplingParams, StructuredOutput, structured

REGEX = r"(\w+\s?){1,50}"


@dataclass(frozen=True)
class Sizes:
    num_streams: int
    stream_prompt: tuple[int, int]
    stream_output: int
    grammar_output: int


FULL = Sizes(8, (32, 64), 96, 64)
QUICK = Sizes(2, (16, 32), 16, 8)
WARMUP = Sizes(1, (16, 32), 4, 4)


def workload(run: Run, sz: Sizes, tag: str, vocab: int, eos: int) -> list[Req]:
    rng = run.rng(f"grammar:{tag}")
    reqs = [Req(f"{tag}-s{i}", run.tokens(rng, rng.randint(*sz.stream_prompt), vocab), sz.stream_output)
            for i in range(sz.num_streams)]
    # sampled (the random model's greedy choice would end the words at once); EOS kept out until the grammar is done
    params = SamplingParams(max_tokens=sz.grammar_output, temperature=1.0, seed=run.seed, logit_bias={eos: -100.0},
                            structured_output=StructuredOutput("regex", REGEX))
    return [*reqs, Req(f"{tag}-grammar", run.tokens(rng, sz.stream_prompt[0], vocab), sz.grammar_output, params=params)]


class _InStep(EngineSystem):
    """Every grammar mask made in the step (the engine before masks could be made off it)."""

    def run(self, reqs, desc="", progress=True, on_step=None) -> Trace:
        slow, structured.SLOW_MASK_S = structured.SLOW_MASK_S, float("inf")
        try:
            return super().run(reqs, desc, progress, on_step)
        finally:
            structured.SLOW_MASK_S = slow


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    cfg = model_config(run.model_dir)
    vocab, eos = cfg["vocab_size"], cfg["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    blocks = (sz.num_streams + 1) * -(-(sz.stream_prompt[1] + max(sz.stream_output, sz.grammar_output)) // 16) + 16

    def config() -> EngineConfig:
        return EngineConfig(model=str(run.model_dir), dtype=run.dtype, max_num_seqs=sz.num_streams + 1,
                            num_kv_blocks=blocks, seed=run.seed)

    systems = [EngineSystem("masks-off-step", config()), _InStep("masks-in-step", config())]

    def row(s, tr: Trace) -> dict:
        grammar = next(r for r in tr.arrival if r.endswith("-grammar"))
        ts = tr.tokens[grammar]
        return {
            **summarize(s.name, tr, [r for r in tr.arrival if r != grammar]),
            "grammar_tokens": len(ts),
            "grammar_tokens_s": round(len(ts) / (ts[-1] - tr.arrival[grammar]), 2),
        }

    rows, traces = measure(
        systems,
        workload=lambda tag: workload(run, sz, tag, vocab, eos),
        warmup=lambda tag: workload(run, WARMUP, tag, vocab, eos),
        row=row, rounds=run.rounds, progress=run.progress,
    )
    for s in systems:
        s.close()
    by = {r["system"]: r for r in rows}
    off, on = by.get("masks-off-step", {}), by.get("masks-in-step", {})
    targets = [
        report.target("free streams' max ITL, masks off the step / in it (same round, median)",
                      report.paired_ratio(off, on, "itl_max_ms"), "<=", 0.5),
        report.target("free streams' ITL p99, masks off the step / in it (same round, median)",
                      report.paired_ratio(off, on, "itl_p99_ms"), "<=", 0.5),
    ]

    def plot():
        fig, ax = plt.subplots(figsize=(7, 3))
        names = [s.name for s in systems if s.name in by and not by[s.name].get("error")]
        keys = ["itl_p50_ms", "itl_p99_ms", "itl_max_ms"]
        for j, name in enumerate(names):
            ax.bar([i + 0.4 * j for i in range(len(keys))], [by[name][k] or 0 for k in keys], 0.4, label=name)
        ax.set_xticks([i + 0.2 for i in range(len(keys))], keys)
        ax.set_yscale("log")
        ax.set_ylabel("free streams' ms")
        ax.legend(fontsize=8)
        ax.set_title(f"grammar: {sz.num_streams} free streams beside one request held to {REGEX}", fontsize=9)
        fig.tight_layout()
        return fig

    report.write(
        run, "grammar", rows,
        columns=["itl_p50_ms", "itl_p99_ms", "itl_max_ms", "grammar_tokens", "grammar_tokens_s", "throughput_tok_s",
                 "wall_s", "error"],
        config={**asdict(sz), "regex": REGEX, "rounds": run.rounds}, targets=targets, plot=plot,
    )
    return {"rows": rows, "targets": targets}
