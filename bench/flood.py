"""flood: one WebSocket client floods 1 MB frames of 28,000 one-character messages; how fast does a neighbour stream?

The neighbour is one greedy chat of `tokens` tokens on its own connection. The flooder (`bench/flooder.py`, a
process of its own at niceness 19, from another address: an attacker's CPU is elsewhere) sends the next frame as
soon as the last one is refused. Before the tokenizer thread and the loop budget, each such frame froze the engine
thread ~0.7 s.
Rounds alternate alone / flooded; the targets are medians of same-round ratios.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from bench import report
from bench.common import Run
from bench.serve import CLIENT_NICE, Server


@dataclass(frozen=True)
class Sizes:
    tokens: int  # the neighbour's completion
    rounds: int


FULL = Sizes(1024, 4)
QUICK = Sizes(64, 1)


async def _neighbour(url: str, tokens: int) -> list[float]:
    """Arrival times of the neighbour's deltas, from its send."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, ping_interval=None) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({"type": "chat", "id": "n", "max_tokens": tokens, "temperature": 0.0,
                                  "ignore_eos": True, "messages": [{"role": "user", "content": "neighbour"}]}))
        stamps = [time.perf_counter()]
        async for raw in ws:
            m = json.loads(raw)
            if m["type"] == "delta":
                stamps.append(time.perf_counter())
            elif m["type"] == "done":
                return stamps
            elif m["type"] == "error":
                raise RuntimeError(f"neighbour failed: {m}")
    raise RuntimeError("neighbour: connection closed before done")


def _round(url: str, tokens: int, flooded: bool) -> dict:
    """One neighbour run, in a client thread at niceness CLIENT_NICE, beside the flooder process if `flooded`."""
    import uvloop

    def client() -> list[float]:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CLIENT_NICE)
        return uvloop.run(_neighbour(url, tokens))

    flooder = None
    if flooded:
        flooder = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "bench.flooder", url, "127.0.0.2"],
                                   cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)
        for _ in range(3):  # under way: three frames refused
            if flooder.stdout.readline() != "prompt_too_long\n":
                raise RuntimeError("the flooder's frames were not refused as too long")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stamps = pool.submit(client).result()
    finally:
        frames = 0
        if flooder is not None:
            flooder.kill()
            frames = 3 + len(flooder.communicate()[0].splitlines())
    gaps = np.diff(stamps[1:])
    wall = stamps[-1] - stamps[0]
    return {"tok_s": tokens / wall, "gap_max_ms": float(gaps.max() * 1e3), "gap_p50_ms": float(np.median(gaps) * 1e3),
            "flood_frames_per_s": frames / wall, "gaps": gaps}


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    rounds = max(run.rounds, sz.rounds) if not run.quick else 1
    server = Server(run, ["--max-model-len", "4096", "--num-kv-blocks", "512"])
    results: dict[str, list[dict]] = {"alone": [], "flooded": []}
    try:
        server.wait_ready()
        _round(server.url, 16, False)  # warm-up
        for k in range(rounds):
            for kind in (("alone", "flooded") if k % 2 == 0 else ("flooded", "alone")):
                results[kind].append(_round(server.url, sz.tokens, kind == "flooded"))
    finally:
        server.stop()

    def row(kind: str) -> dict:
        rs = results[kind]
        best = max(rs, key=lambda r: r["tok_s"])
        return {"system": kind, "throughput_tok_s": round(best["tok_s"], 1), "itl_p50_ms": round(best["gap_p50_ms"], 2),
                "itl_max_ms": round(best["gap_max_ms"], 2), "flood_frames_per_s": round(best["flood_frames_per_s"], 1),
                "rounds": {"throughput_tok_s": [round(r["tok_s"], 1) for r in rs],
                           "itl_max_ms": [round(r["gap_max_ms"], 2) for r in rs],
                           "flood_frames_per_s": [round(r["flood_frames_per_s"], 1) for r in rs]}}

    rows = [row("alone"), row("flooded")]
    pairs = list(zip(results["flooded"], results["alone"]))
    tok = float(np.median([f["tok_s"] / a["tok_s"] for f, a in pairs]))
    gap = float(np.median([f["gap_max_ms"] / a["gap_max_ms"] for f, a in pairs]))
    targets = [report.target("neighbour tok/s flooded / alone (same round, median)", round(tok, 3), ">=", 0.7),
               report.target("neighbour max ITL flooded / alone (same round, median)", round(gap, 3), "<=", 3.0)]

    def plot():
        fig, ax = plt.subplots(figsize=(7, 3.4))
        for kind, color in (("alone", "#999999"), ("flooded", "#c44e52")):
            gaps = results[kind][0]["gaps"]
            ax.plot(np.arange(len(gaps)), gaps * 1e3, lw=0.7, color=color, label=f"{kind} (max {gaps.max() * 1e3:.1f} ms)")
        ax.set_xlabel("neighbour token")
        ax.set_ylabel("gap to the previous token, ms")
        ax.set_title("a neighbour stream while one client floods oversized prompts", fontsize=9)
        ax.legend(fontsize=8)
        return fig

    report.write(run, "flood", rows, columns=["throughput_tok_s", "itl_p50_ms", "itl_max_ms", "flood_frames_per_s"],
                 config={**asdict(sz), "rounds": rounds}, targets=targets, plot=plot)
    return {"rows": rows, "targets": targets}
