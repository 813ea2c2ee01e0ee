"""tiers: chats on many distinct system prompts, four times what the KV pool holds; the host tier on vs off.

Each chat opens with one of `num_prompts` system prompts (drawn at random), so a prompt comes back after the
device pool has usually evicted it. Without a host tier it is recomputed; with one (`kv_offload_gb` sized to hold
every prompt) it is copied back. Arrivals are Poisson at `load` x the device-only system's capacity, measured in
this run (as in `prefix`); both systems see the same schedule.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from bench import report
from bench.common import Run, model_config
from bench.driver import EngineSystem, Req, Trace, calibrate_capacity, measure, poisson, summarize
from engine import EngineConfig
from engine.layout import kv_block_bytes
from engine.models import ModelConfig


@dataclass(frozen=True)
class Sizes:
    num_prompts: int  # distinct system prompts
    system_prompt: int
    num_chats: int
    user_turn: tuple[int, int]
    output: int
    calibration_chats: int
    load: float  # arrival rate / device-only capacity
    max_num_seqs: int


FULL = Sizes(16, 512, 128, (16, 32), 16, 8, 0.8, max_num_seqs=4)
QUICK = Sizes(8, 64, 24, (8, 16), 4, 4, 0.8, max_num_seqs=2)
WARMUP = Sizes(2, 32, 2, (8, 16), 2, 0, 0.0, 0)
BLOCK = 16


def device_blocks(sz: Sizes) -> int:
    """A pool holding a quarter of the system prompts, beside what the running chats need of their own."""
    per_prompt = sz.system_prompt // BLOCK
    own = -(-(sz.user_turn[1] + sz.output) // BLOCK) + 1
    return sz.num_prompts * per_prompt // 4 + sz.max_num_seqs * (per_prompt + own)


def chats(run: Run, sz: Sizes, tag: str, vocab: int, n: int, rate: float | None, salt: str = "") -> list[Req]:
    """`n` chats, each on one of the `num_prompts` system prompts at random, Poisson at `rate`/s (None: at once)."""
    rng = run.rng(f"tiers:prompts{salt}")
    systems = [run.tokens(rng, sz.system_prompt, vocab) for _ in range(sz.num_prompts)]
    rng = run.rng(f"tiers:{tag}")
    return poisson(tag, n, rate, rng, lambda i: systems[rng.randrange(sz.num_prompts)]
                   + run.tokens(rng, rng.randint(*sz.user_turn), vocab), sz.output)


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    cfg = model_config(run.model_dir)
    vocab = cfg["vocab_size"]
    block_bytes = kv_block_bytes(ModelConfig.from_hf(cfg), BLOCK, run.torch_dtype)
    host_gb = 1.25 * sz.num_prompts * (sz.system_prompt // BLOCK) * block_bytes / (1 << 30)  # every prompt, and room

    def system(name: str, offload_gb: float) -> EngineSystem:
        return EngineSystem(name, EngineConfig(
            model=str(run.model_dir), dtype=run.dtype, block_size=BLOCK, num_kv_blocks=device_blocks(sz),
            max_num_seqs=sz.max_num_seqs, kv_offload_gb=offload_gb, seed=run.seed))

    host, device = system("host-tier", host_gb), system("device-only", 0.0)
    systems = [host, device]
    capacity = calibrate_capacity(device, chats(run, WARMUP, "warm-cal", vocab, 2, None, salt="warm"),
                                  chats(run, sz, "cal", vocab, sz.calibration_chats, None, salt="cal"), run.progress)
    rate = sz.load * capacity  # of the system without the host tier

    def row(s, tr: Trace) -> dict:
        return summarize(s.name, tr, arrival_rate_per_s=round(rate, 3), host_cache_hits=tr.stats["host_cache_hits"],
                         host_copy_s=round(tr.stats["host_copy_seconds"], 3))

    rows, traces = measure(
        systems,
        workload=lambda tag: chats(run, sz, tag, vocab, sz.num_chats, rate),
        warmup=lambda tag: chats(run, WARMUP, tag, vocab, 2, None, salt="warm"),
        row=row, rounds=run.rounds, progress=run.progress,
    )
    for s in systems:
        s.close()
    by = {r["system"]: r for r in rows}
    r_on, r_off = by["host-tier"], by["device-only"]
    computed = report.ratio(r_on.get("prompt_tokens_computed"), r_off.get("prompt_tokens_computed"))
    targets = [
        report.target("TTFT p50 host tier / device only (same round, median)",
                      report.paired_ratio(r_on, r_off, "ttft_p50_ms"), "<=", 0.3),
        report.target("prompt tokens computed cut (1 - host/device)", None if computed is None else 1 - computed,
                      ">=", 0.7),
    ]

    def plot():
        return report.ttft_cdf(traces, by, (("host-tier", "#4c72b0"), ("device-only", "#999999")),
                               f"tiers: {sz.num_chats} chats on {sz.num_prompts} system prompts of {sz.system_prompt} "
                               f"tokens, a pool of {device_blocks(sz)} blocks")

    report.write(
        run, "tiers", rows,
        columns=["ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s", "prefix_hit_rate", "host_cache_hits",
                 "prompt_tokens_computed", "host_copy_s", "itl_p50_ms", "wall_s", "error"],
        config={**asdict(sz), "device_blocks": device_blocks(sz), "kv_offload_gb": round(host_gb, 4),
                "capacity_chats_per_s": round(capacity, 3), "arrival_rate_per_s": round(rate, 3)},
        targets=targets, plot=plot,
    )
    return {"rows": rows, "targets": targets}
