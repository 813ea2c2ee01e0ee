"""evict: a few hot system prompts among one-off long prompts; which free cached blocks should go first?

Half the chats open with one of `hot` system prompts; the other half are one-off long prompts that are never
seen again (a scan). Under plain LRU, a burst of one-off prompts pushes the hot prompts' blocks out; `slru`
(`EngineConfig.kv_eviction`, engine/block_manager.py) keeps blocks that were hit before until the rest are gone.
Poisson arrivals at `load` x the LRU system's capacity (measured in this run); both see the same schedule.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from bench import report
from bench.common import Run, model_config
from bench.driver import EngineSystem, Req, calibrate_capacity, measure, poisson, summarize
from engine import EngineConfig


@dataclass(frozen=True)
class Sizes:
    hot: int  # hot system prompts
    system_prompt: int
    one_off: int  # tokens of a one-off prompt
    num_chats: int
    user_turn: tuple[int, int]
    output: int
    pool_blocks: int
    calibration_chats: int
    load: float
    max_num_seqs: int


FULL = Sizes(2, 512, 768, 96, (16, 32), 16, 200, 8, 0.8, max_num_seqs=2)
QUICK = Sizes(2, 64, 96, 16, (8, 16), 4, 40, 4, 0.8, max_num_seqs=2)
WARMUP = Sizes(1, 32, 32, 2, (8, 16), 2, 0, 0, 0.0, 0)


def chats(run: Run, sz: Sizes, tag: str, vocab: int, n: int, rate: float | None) -> list[Req]:
    rng = run.rng("evict:hot")
    hot = [run.tokens(rng, sz.system_prompt, vocab) for _ in range(sz.hot)]
    rng = run.rng(f"evict:{tag}")

    def prompt(i: int) -> list[int]:
        if rng.random() < 0.5:
            return hot[rng.randrange(sz.hot)] + run.tokens(rng, rng.randint(*sz.user_turn), vocab)
        return run.tokens(rng, sz.one_off, vocab)

    return poisson(tag, n, rate, rng, prompt, sz.output)


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    vocab = model_config(run.model_dir)["vocab_size"]

    def system(policy: str) -> EngineSystem:
        return EngineSystem(policy, EngineConfig(
            model=str(run.model_dir), dtype=run.dtype, num_kv_blocks=sz.pool_blocks, max_num_seqs=sz.max_num_seqs,
            kv_eviction=policy, seed=run.seed))

    lru, slru = system("lru"), system("slru")
    systems = [slru, lru]
    rate = sz.load * calibrate_capacity(lru, chats(run, WARMUP, "warm-cal", vocab, 2, None),
                                        chats(run, sz, "cal", vocab, sz.calibration_chats, None), run.progress)
    rows, traces = measure(
        systems,
        workload=lambda tag: chats(run, sz, tag, vocab, sz.num_chats, rate),
        warmup=lambda tag: chats(run, WARMUP, tag, vocab, 2, None),
        row=lambda s, tr: summarize(s.name, tr, arrival_rate_per_s=round(rate, 3)),
        rounds=run.rounds, progress=run.progress,
    )
    by = {r["system"]: r for r in rows}
    computed = report.ratio(by["slru"].get("prompt_tokens_computed"), by["lru"].get("prompt_tokens_computed"))
    targets = [
        report.target("prompt tokens computed slru / lru", computed, "<=", 0.9),
        report.target("TTFT p50 slru / lru (same round, median)", report.paired_ratio(by["slru"], by["lru"],
                                                                                       "ttft_p50_ms"), "<=", 1.0),
    ]

    def plot():
        return report.ttft_cdf(traces, by, (("slru", "#4c72b0"), ("lru", "#999999")),
                               f"evict: {sz.hot} hot {sz.system_prompt}-token prompts among one-off {sz.one_off}-token "
                               f"ones, {sz.pool_blocks} blocks")

    report.write(run, "evict", rows,
                 columns=["ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s", "prefix_hit_rate", "prompt_tokens_computed",
                          "itl_p50_ms", "wall_s", "error"],
                 config={**asdict(sz), "arrival_rate_per_s": round(rate, 3)}, targets=targets, plot=plot)
    return {"rows": rows, "targets": targets}
