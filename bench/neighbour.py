"""neighbour: one client's request with `n=128` is decoding (128 streams) when another client's chat arrives: does
the crowd slow the newcomer's tokens?

A step runs every running stream, so without a target the neighbour's inter-token latency is the step time of the
whole crowd. With `itl_slo_ms` the clients share a step's decodes (docs/architecture.md §4): the neighbour's stream
decodes every step, the crowd's take turns in what the target leaves. Systems: `mixed` (no target), `mixed@slo`
(the target: `SLO_X` times a stream's inter-token latency alone, measured first in the same run, since these hosts'
speed swings), and `mixed kv25%` and `mixed@slo kv40%`, with a KV pool of that share of what the streams grow into
(each where the pool runs out while the neighbour runs): the crowd's streams are preempted for blocks, and the
neighbour's should not be (it is the youngest request, but its client holds one seat). Under the target the
neighbour's prompt gets its share of a step too, so its first token comes no later than beside the whole crowd.
The neighbour arrives once every stream of the crowd has a token; the window is its whole stream. In `mixed +prompt`
and `mixed@slo +prompt` the crowd's client also sends a long prompt then, and the neighbour arrives `LAG` steps later,
that prompt still under way under the target: the room the crowd's deferred decodes make is the neighbour's share,
not the long prompt's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


from bench import report
from bench.common import Run, model_config
from bench.driver import EngineSystem, Req, Trace, itls, measure, ms, pct, summarize
from engine import EngineConfig, SamplingParams


@dataclass(frozen=True)
class Sizes:
    prompt: int
    crowd: int  # the first client's streams: its request's n
    crowd_output: int  # long enough to decode through the neighbour's whole stream
    neighbour_output: int
    long_prompt: int = 0  # the crowd's client's long prompt (`+prompt` systems)


FULL = Sizes(32, 128, 224, 64, 1536)
QUICK = Sizes(16, 32, 48, 16, 256)
WARMUP = Sizes(16, 8, 8, 4, 64)
SLO_X = 4.0
LAG = 2  # engine steps from the crowd's long prompt to the neighbour (`+prompt` systems)
LONG_OUTPUT = 4


@dataclass
class Scenario:
    crowd: list[Req]
    neighbour: Req  # arrives once every stream of the crowd has a token
    long: Req  # the crowd's client's long prompt (`+prompt` systems): arrives then, the neighbour LAG steps later


def scenario(run: Run, sz: Sizes, tag: str, vocab: int) -> Scenario:
    rng = run.rng(f"neighbour:{tag}")
    neighbour = Req(f"{tag}-neighbour", run.tokens(rng, sz.prompt, vocab), sz.neighbour_output, client="neighbour")
    prompt = run.tokens(rng, sz.prompt, vocab)  # (one request's n streams: one prompt, each its own seeded draws)
    crowd = [Req(f"{tag}-crowd{i}", prompt, sz.crowd_output, client="crowd",
                 params=SamplingParams(max_tokens=sz.crowd_output, temperature=1.0, seed=i, ignore_eos=True))
             for i in range(sz.crowd)]
    long = Req(f"{tag}-long", run.tokens(rng, sz.long_prompt, vocab), LONG_OUTPUT, client="crowd")
    return Scenario(crowd, neighbour, long)


class _System(EngineSystem):
    def __init__(self, name: str, config: EngineConfig, long_prompt: bool = False):
        super().__init__(name, config)
        self.long_prompt = long_prompt

    def run(self, sc: Scenario, desc: str = "", progress: bool = True, on_step=None) -> Trace:
        steps: list[int] = []  # (steps since the crowd's streams all had a token)

        def arrive(tr: Trace, now: float) -> list[Req]:
            if not steps:
                if any(r.rid not in tr.tokens for r in sc.crowd):
                    return []
                steps.append(0)
                return [sc.long] if self.long_prompt else [sc.neighbour]
            steps[0] += 1
            return [sc.neighbour] if self.long_prompt and steps[0] == LAG else []

        return super().run(sc.crowd, desc, progress, on_step=arrive)


def window(tr: Trace) -> tuple[float, float, str, list[str]]:
    """The neighbour's arrival and last token, its request id, and the crowd's."""
    neighbour = next(r for r in tr.arrival if r.endswith("-neighbour"))
    return tr.arrival[neighbour], tr.tokens[neighbour][-1], neighbour, [r for r in tr.arrival if "-crowd" in r]


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    vocab = model_config(run.model_dir)["vocab_size"]
    # room for every stream whole, but in the `kv` systems
    blocks = sz.crowd * -(-(sz.prompt + sz.crowd_output) // 16) + -(-(sz.prompt + sz.neighbour_output) // 16) + 32

    def system(name: str, slo: float | None = None, kv: float = 1.0, long_prompt: bool = False) -> _System:
        extra = -(-(sz.long_prompt + LONG_OUTPUT) // 16) if long_prompt else 0
        return _System(name, EngineConfig(
            model=str(run.model_dir), dtype=run.dtype, max_num_seqs=sz.crowd + 1 + long_prompt,
            num_kv_blocks=int(kv * blocks) + extra, seed=run.seed, itl_slo_ms=slo), long_prompt)

    plain = system("mixed")
    # the target: the neighbour's inter-token latency alone, times SLO_X (after a warm-up: a cold engine's first
    # steps time its setup)
    plain.run(scenario(run, WARMUP, "calibrate-warm", vocab), desc="calibrating", progress=run.progress)
    alone = scenario(run, Sizes(sz.prompt, 1, 48, 0), "calibrate", vocab).crowd
    tr = EngineSystem.run(plain, alone, desc="calibrating", progress=run.progress)
    slo_ms = round(SLO_X * 1000 * pct(itls(tr), 50), 1)
    systems = [plain, system("mixed@slo", slo_ms), system("mixed kv25%", kv=0.25),
               system("mixed@slo kv40%", slo_ms, 0.4), system("mixed +prompt", long_prompt=True),
               system("mixed@slo +prompt", slo_ms, long_prompt=True)]

    def row(s, tr: Trace) -> dict:
        start, end, neighbour, crowd = window(tr)
        gaps = itls(tr, [neighbour])
        crowd_gaps = itls(tr, crowd, (start, end))
        crowd_tokens = sum(start < t <= end for r in crowd for t in tr.tokens[r])
        return {
            **summarize(s.name, tr),
            "itl_p50_ms": ms(pct(gaps, 50)), "itl_p99_ms": ms(pct(gaps, 99)), "itl_max_ms": ms(max(gaps)),
            "neighbour_ttft_ms": ms(tr.ttft(neighbour)),
            "crowd_itl_p50_ms": ms(pct(crowd_gaps, 50)),
            "crowd_tok_s": round(crowd_tokens / (end - start), 2),
            "deferred_decodes": tr.stats["deferred_decodes"],
        }

    rounds = run.rounds if run.quick else max(run.rounds, 3)
    rows, traces = measure(
        systems,
        workload=lambda tag: scenario(run, sz, tag, vocab),
        warmup=lambda tag: scenario(run, WARMUP, tag, vocab),
        row=row, rounds=rounds, progress=run.progress,
    )
    for s in systems:
        s.close()
    by = {r["system"]: r for r in rows}
    m, slo, kv, slo_kv, slo_long = (by.get(name, {}) for name in (
        "mixed", "mixed@slo", "mixed kv25%", "mixed@slo kv40%", "mixed@slo +prompt"))
    targets = [
        report.target(f"neighbour ITL p50 ms, mixed@slo (target {slo_ms:g} ms)", slo.get("itl_p50_ms"), "<=", slo_ms),
        report.target(f"neighbour ITL p99 ms, mixed@slo (target {slo_ms:g} ms)", slo.get("itl_p99_ms"), "<=", slo_ms),
        report.target("crowd tok/s beside the neighbour, mixed@slo / mixed (same round, median)",
                      report.paired_ratio(slo, m, "crowd_tok_s"), ">=", 0.5),
        report.target("neighbour TTFT, mixed@slo / mixed (same round, median)",
                      report.paired_ratio(slo, m, "neighbour_ttft_ms"), "<=", 1.0),
        # (a step to wait for, then the step of its prompt's share: each at most the target)
        report.target("neighbour TTFT ms beside the crowd's long prompt, mixed@slo +prompt (2x the target)",
                      slo_long.get("neighbour_ttft_ms"), "<=", 2 * slo_ms),
        report.target("neighbour max ITL, mixed kv25% / mixed (same round, median)",
                      report.paired_ratio(kv, m, "itl_max_ms"), "<=", 1.5),
        report.target("neighbour max ITL, mixed@slo kv40% / mixed@slo (same round, median)",
                      report.paired_ratio(slo_kv, slo, "itl_max_ms"), "<=", 1.5),
    ]

    def plot():
        names = [s.name for s in systems if s.name in traces]
        fig, axes = report.gap_panels(names, 1.6)
        for ax, name in zip(axes, names):
            tr = traces[name]
            start, _, neighbour, _ = window(tr)
            report.draw_gaps(ax, tr.tokens[neighbour], start)
            ax.set_title(f"{name}: neighbour ITL p50 {by[name]['itl_p50_ms']:,.0f} ms, "
                         f"crowd {by[name]['crowd_tok_s']:,.0f} tok/s beside it", fontsize=8, loc="left")
        axes[-1].set_xlabel("seconds since the neighbour arrived")
        fig.suptitle(f"neighbour: one stream beside another client's request with n={sz.crowd}", fontsize=10)
        fig.tight_layout()
        return fig

    report.write(
        run, "neighbour", rows,
        columns=["itl_p50_ms", "itl_p99_ms", "itl_max_ms", "neighbour_ttft_ms", "crowd_itl_p50_ms", "crowd_tok_s",
                 "deferred_decodes", "num_preemptions", "error"],
        config={**asdict(sz), "rounds": rounds, "itl_slo_ms": slo_ms}, targets=targets, plot=plot,
    )
    return {"rows": rows, "targets": targets}
