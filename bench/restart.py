"""restart: a server pins a 2,000-token system prompt; how soon after a restart does its first chat get a token?

Each round "restarts" an engine (builds a new one, weights loaded) and times, from the engine built: pinning the
system prompt (`LLMEngine.pin_prefix`, as `--pin-system-prompt` does at start-up), then the first chat on it to
its first token. `store` loads the prompt's KV from the prefix store (written by an earlier start: the warm-up);
`no-store` computes it. Both keep the same $SLUICE_HOME (a temporary one; its native kernels are the real one's).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt

from bench import report
from bench.common import Run, model_config
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import kernel_cache_dir


@dataclass(frozen=True)
class Sizes:
    system_prompt: int
    user_turn: int
    rounds: int  # restarts per system (at least)


FULL = Sizes(2000, 32, 3)
QUICK = Sizes(256, 16, 1)


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    vocab = model_config(run.model_dir)["vocab_size"]
    rng = run.rng("restart")
    system = run.tokens(rng, sz.system_prompt, vocab)
    chat = system + run.tokens(rng, sz.user_turn, vocab)
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    home = tempfile.mkdtemp(prefix="sluice-bench-restart-")
    kernel_cache_dir().mkdir(parents=True, exist_ok=True)
    os.symlink(kernel_cache_dir().resolve(), Path(home) / kernel_cache_dir().name)  # compiled once per CPU, not once per run
    previous = os.environ.get("SLUICE_HOME")
    os.environ["SLUICE_HOME"] = home  # NOTE: read by the engine when it pins (engine.config.sluice_home)

    def start(store: bool) -> dict:
        eng = LLMEngine(EngineConfig(model=str(run.model_dir), dtype=run.dtype, seed=run.seed, prefix_store=store,
                                     max_model_len=sz.system_prompt + sz.user_turn + 64))
        t0 = time.perf_counter()
        eng.pin_prefix(system)
        t1 = time.perf_counter()
        out = eng.generate([chat], first_token)[0]
        t2 = time.perf_counter()
        return {"pin_ms": 1000 * (t1 - t0), "first_token_ms": 1000 * (t2 - t0), "cached": out.num_cached_tokens,
                "computed": eng.stats()["prompt_tokens_computed"], "token": out.token_ids[0]}

    try:
        start(True)  # warm-up: kernels, and the store written, as by the server's previous start
        runs: dict[str, list[dict]] = {"store": [], "no-store": []}
        for _ in range(max(sz.rounds, run.rounds)):
            for name in runs:
                runs[name].append(start(name == "store"))
    finally:
        if previous is None:
            os.environ.pop("SLUICE_HOME", None)
        else:
            os.environ["SLUICE_HOME"] = previous
    rows = []
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["first_token_ms"])
        rows.append({"system": name, "first_token_ms": round(best["first_token_ms"], 1),
                     "pin_ms": round(best["pin_ms"], 1), "prompt_tokens_computed": best["computed"],
                     "num_cached_tokens": best["cached"],
                     "rounds": {"first_token_ms": [round(r["first_token_ms"], 1) for r in rs]}})
    by = {r["system"]: r for r in rows}
    same = all(r["token"] == runs["no-store"][0]["token"] for rs in runs.values() for r in rs)
    ratios = [n["first_token_ms"] / s["first_token_ms"] for s, n in zip(runs["store"], runs["no-store"])]
    targets = [
        report.target("first token after a restart: no-store / store (same round, median)",
                      statistics.median(ratios), ">=", 5.0),
        report.target("the same first token either way", float(same), ">=", 1.0),
    ]

    def plot():
        fig, ax = plt.subplots(figsize=(6, 3))
        names = list(by)
        ax.barh(names, [by[n]["first_token_ms"] for n in names], color=["#4c72b0", "#999999"])
        ax.set_xlabel("ms from the engine built to the first chat's first token (best round)")
        ax.set_title(f"restart: a pinned {sz.system_prompt}-token system prompt", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
        return fig

    report.write(run, "restart", rows, columns=["first_token_ms", "pin_ms", "prompt_tokens_computed",
                                                 "num_cached_tokens"],
                 config=asdict(sz), targets=targets, plot=plot)
    return {"rows": rows, "targets": targets}
