"""stall: streams are decoding when one long prompt arrives; does its prefill stall their tokens?

The long prompt arrives as soon as every stream has produced `trigger` tokens. The window is from
its arrival to its first token; the ITL metrics are the streams' token gaps that overlap the window.
Systems: `mixed` (chunked prefill) at a sweep of token budgets, `mixed@slo` (the largest budget as a cap, each
step's prompt tokens sized from the engine's step-cost model to keep the streams' ITL under `ITL_SLO_MS`),
`prefill_first` (whole prompts, decodes wait) and `static` (the long prompt waits for the running batch to finish).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from bench import report
from bench.common import Run, model_config
from bench.driver import EngineSystem, Req, Trace, itls, measure, ms, pct, summarize
from engine import EngineConfig


@dataclass(frozen=True)
class Sizes:
    num_streams: int
    stream_prompt: tuple[int, int]
    stream_output: int  # long enough to keep decoding through the slowest (mixed@128) prefill window
    long_prompt: int
    long_output: int
    trigger: int  # stream tokens before the long prompt arrives
    budgets: tuple[int, ...]


# NOTE: the small model's context is 4,096 positions, so the "4,096-token" prompt is 4,080 + 16 outputs.
FULL = Sizes(16, (64, 128), 64, 4080, 16, 4, (64, 128, 256, 512))
QUICK = Sizes(4, (16, 32), 16, 512, 2, 2, (128, 256, 512))
# The streams' ITL target of `mixed@slo`, for 2 CPU cores and the small model: between what the swept budgets give
# (on the AVX512-BF16 Xeon, ITL p99 in the window ~250 ms at 128, ~380 at 256, ~820 at 512).
ITL_SLO_MS = 300.0
WARMUP = Sizes(2, (16, 32), 6, 128, 2, 2, ())


@dataclass
class Scenario:
    streams: list[Req]
    long: Req  # arrives once every stream has `trigger` tokens
    trigger: int


def scenario(run: Run, sz: Sizes, tag: str, vocab: int) -> Scenario:
    rng = run.rng(f"stall:{tag}")
    streams = [Req(f"{tag}-s{i}", run.tokens(rng, rng.randint(*sz.stream_prompt), vocab), sz.stream_output)
               for i in range(sz.num_streams)]
    return Scenario(streams, Req(f"{tag}-long", run.tokens(rng, sz.long_prompt, vocab), sz.long_output), sz.trigger)


class _Trigger:
    """`on_step` hook: the long prompt arrives once every stream has `n` tokens."""

    def __init__(self, streams: list[Req], long: Req, n: int):
        self.ids, self.long, self.n, self.fired = [r.rid for r in streams], long, n, False

    def __call__(self, tr: Trace, now: float) -> list[Req]:
        if self.fired or any(len(tr.tokens.get(r, [])) < self.n for r in self.ids):
            return []
        self.fired = True
        return [self.long]


class _StallSystem(EngineSystem):
    def run(self, sc: Scenario, desc: str = "", progress: bool = True, on_step=None) -> Trace:
        return super().run(sc.streams, desc, progress, on_step=_Trigger(sc.streams, sc.long, sc.trigger))


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    vocab = model_config(run.model_dir)["vocab_size"]
    blocks = sz.num_streams * -(-(sz.stream_prompt[1] + sz.stream_output) // 16) + -(-(sz.long_prompt + sz.long_output) // 16) + 32

    def system(name: str, policy: str, budget: int, slo: float | None = None) -> _StallSystem:
        return _StallSystem(name, EngineConfig(
            model=str(run.model_dir), dtype=run.dtype, scheduling=policy, max_num_seqs=sz.num_streams + 1,
            max_num_batched_tokens=budget, num_kv_blocks=blocks, seed=run.seed, itl_slo_ms=slo))

    systems = [system(f"mixed@{b}", "mixed", b) for b in sz.budgets]
    systems += [system("mixed@slo", "mixed", max(sz.budgets), ITL_SLO_MS)]
    systems += [system("prefill_first", "prefill_first", 256), system("static", "static", 256)]

    def long_window(tr: Trace) -> tuple[str, float, float]:
        long = next(r for r in tr.arrival if r.endswith("-long"))
        return long, tr.arrival[long], tr.tokens[long][0]

    def row(s, tr: Trace) -> dict:
        long, a, first = long_window(tr)
        streams = [r for r in tr.arrival if r != long]
        window = itls(tr, streams, (a, first))
        base = summarize(s.name, tr)
        return {
            **base,
            "itl_p50_ms": ms(pct(window, 50)), "itl_p99_ms": ms(pct(window, 99)),
            "itl_max_ms": ms(max(window) if window else None),
            "long_ttft_ms": ms(first - a),
            "stream_itl_p99_ms_whole_run": base["itl_p99_ms"],
            "window_gaps": len(window),
        }

    # a round is ~4 s per system, short enough for a neighbour on the shared host to skew one: keep the
    # best of at least 5 (as serve keeps the best of 3)
    rounds = run.rounds if run.quick else max(run.rounds, 5)
    rows, traces = measure(
        systems,
        workload=lambda tag: scenario(run, sz, tag, vocab),
        warmup=lambda tag: scenario(run, WARMUP, tag, vocab),
        row=row, rounds=rounds, progress=run.progress,
    )
    for s in systems:
        s.close()
    by = {r["system"]: r for r in rows}
    m, pf = by.get("mixed@256", {}), by.get("prefill_first", {})
    # the ITL target: the fixed budget with the shortest long-prompt TTFT among those that meet it, against mixed@slo
    slo = by.get("mixed@slo", {})
    meeting = [by[f"mixed@{b}"] for b in sz.budgets
               if f"mixed@{b}" in by and by[f"mixed@{b}"].get("itl_p99_ms") is not None
               and by[f"mixed@{b}"]["itl_p99_ms"] <= ITL_SLO_MS]
    best = min(meeting, key=lambda r: r["long_ttft_ms"], default={})
    targets = [
        report.target("max ITL mixed@256 / prefill_first (same round, median)", report.paired_ratio(m, pf, "itl_max_ms"), "<=", 0.2),
        report.target("throughput mixed@256 / prefill_first (same round, median)", report.paired_ratio(m, pf, "throughput_tok_s"), ">=", 0.9),
        report.target(f"ITL p99 ms mixed@slo (target {ITL_SLO_MS:g} ms)", slo.get("itl_p99_ms"), "<=", ITL_SLO_MS),
        report.target(f"long-prompt TTFT mixed@slo / best fixed budget meeting {ITL_SLO_MS:g} ms "
                      f"({best.get('system', 'none')}; same round, median)",
                      report.paired_ratio(slo, best, "long_ttft_ms") if best else None, "<=", 1.1),
    ]

    def plot():
        names = [s.name for s in systems if s.name in traces]
        fig, axes = report.gap_panels(names, 1.5)
        for ax, name in zip(axes, names):
            tr = traces[name]
            _, a, first = long_window(tr)
            for rid in tr.arrival:
                ts = tr.tokens.get(rid, [])
                if not rid.endswith("-long") and len(ts) >= 2:
                    report.draw_gaps(ax, ts, a, alpha=0.5)
            ax.axvspan(0, first - a, color="#dd8452", alpha=0.25, lw=0)
            ax.set_title(f"{name}: long-prompt TTFT {1000 * (first - a):,.0f} ms, "
                         f"window max ITL {by[name]['itl_max_ms']:,.0f} ms", fontsize=8, loc="left")
        axes[-1].set_xlabel("seconds since the long prompt arrived (shaded: until its first token)")
        fig.suptitle(f"stall: {sz.num_streams} decoding streams, one {sz.long_prompt}-token prompt arrives", fontsize=10)
        fig.tight_layout()
        return fig

    report.write(
        run, "stall", rows,
        columns=["itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_ms", "throughput_tok_s", "ttft_p50_ms",
                 "wall_s", "error"],
        config={**asdict(sz), "rounds": rounds}, targets=targets, plot=plot,
    )
    return {"rows": rows, "targets": targets}
