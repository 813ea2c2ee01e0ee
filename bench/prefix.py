"""prefix: chats sharing one long system prompt, Poisson arrivals; prefix caching on vs off.

The arrival rate is `load` x the cache-off system's capacity, measured in this run (a calibration
batch, all at once, with a different system prompt), so the baseline is busy but not overloaded;
both systems then see the same arrival schedule. Prompt tokens computed and hit rate come from
the engine's counters (`LLMEngine.stats()`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from bench import report
from bench.common import Run, model_config
from bench.driver import EngineSystem, Req, Trace, calibrate_capacity, measure, poisson, summarize
from engine import EngineConfig


@dataclass(frozen=True)
class Sizes:
    num_chats: int
    system_prompt: int
    user_turn: tuple[int, int]
    output: int
    calibration_chats: int
    load: float  # arrival rate / cache-off capacity
    max_num_seqs: int
    max_num_batched_tokens: int


FULL = Sizes(64, 1024, (32, 64), 64, 8, 0.8, max_num_seqs=32, max_num_batched_tokens=512)
QUICK = Sizes(6, 128, (8, 16), 4, 2, 0.8, max_num_seqs=8, max_num_batched_tokens=256)
WARMUP = Sizes(2, 32, (8, 16), 2, 0, 0.0, 0, 0)


def chats(run: Run, sz: Sizes, tag: str, vocab: int, n: int, rate: float | None) -> list[Req]:
    """`n` chats on one system prompt (drawn from `tag`), arriving as a Poisson process of `rate`/s (None: at once)."""
    rng = run.rng(f"prefix:{tag}")
    system = run.tokens(rng, sz.system_prompt, vocab)
    return poisson(tag, n, rate, rng, lambda i: system + run.tokens(rng, rng.randint(*sz.user_turn), vocab), sz.output)


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    vocab = model_config(run.model_dir)["vocab_size"]
    per_chat = -(-(sz.system_prompt + sz.user_turn[1] + sz.output) // 16)
    blocks = (sz.max_num_seqs + 2) * per_chat + 64

    def system(name: str, caching: bool) -> EngineSystem:
        return EngineSystem(name, EngineConfig(
            model=str(run.model_dir), dtype=run.dtype, scheduling="mixed", max_num_seqs=sz.max_num_seqs,
            max_num_batched_tokens=sz.max_num_batched_tokens, enable_prefix_caching=caching,
            num_kv_blocks=blocks, seed=run.seed))

    on, off = system("prefix-cache-on", True), system("prefix-cache-off", False)
    systems = [on, off]
    capacity = calibrate_capacity(off, chats(run, WARMUP, "warm-cal", vocab, WARMUP.num_chats, None),
                                  chats(run, sz, "cal", vocab, sz.calibration_chats, None), run.progress)  # cache off
    rate = sz.load * capacity

    def row(s, tr: Trace) -> dict:
        return summarize(s.name, tr, arrival_rate_per_s=round(rate, 3))

    rows, traces = measure(
        systems,
        workload=lambda tag: chats(run, sz, tag, vocab, sz.num_chats, rate),
        warmup=lambda tag: chats(run, WARMUP, tag, vocab, WARMUP.num_chats, None),
        row=row, rounds=run.rounds, progress=run.progress,
    )
    for s in systems:
        s.close()
    by = {r["system"]: r for r in rows}
    r_on, r_off = by["prefix-cache-on"], by["prefix-cache-off"]
    computed = report.ratio(r_on.get("prompt_tokens_computed"), r_off.get("prompt_tokens_computed"))
    targets = [
        report.target("TTFT p50 cache-on / cache-off (same round, median)", report.paired_ratio(r_on, r_off, "ttft_p50_ms"), "<=", 0.15),
        report.target("prompt tokens computed cut (1 - on/off)", None if computed is None else 1 - computed, ">=", 0.9),
    ]

    def plot():
        return report.ttft_cdf(traces, by, (("prefix-cache-on", "#4c72b0"), ("prefix-cache-off", "#999999")),
                               f"prefix: {sz.num_chats} chats, {sz.system_prompt}-token shared system prompt, "
                               f"Poisson {rate:.2f}/s ({sz.load:.0%} of cache-off capacity)")

    report.write(
        run, "prefix", rows,
        columns=["ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s", "prefix_hit_rate", "prompt_tokens_computed",
                 "itl_p50_ms", "itl_p99_ms", "wall_s", "error"],
        config={**asdict(sz), "capacity_chats_per_s": round(capacity, 3), "arrival_rate_per_s": round(rate, 3)},
        targets=targets, plot=plot,
    )
    return {"rows": rows, "targets": targets}
