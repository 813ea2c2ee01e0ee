"""Drives `LLMEngine` through a request schedule and time-stamps every token; turns traces into metrics.

The clock is `time.perf_counter()` everywhere (transformers' continuous batching uses it too).
A token's time stamp is the end of the step that produced it; TTFT runs from the request's
arrival (its scheduled time, even when the engine was busy in a step then) to its first token.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
from tqdm import tqdm

from engine import EngineConfig, LLMEngine, SamplingParams
from service.engine_thread import freeze_startup_heap


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # arrival, seconds after the run starts
    params: SamplingParams | None = None  # default: `sampling(max_tokens)`, greedy to the end
    client: Hashable = None  # who asks (a server's peer address): the scheduler shares the engine between clients


def poisson(tag: str, n: int, rate: float | None, rng, prompt: Callable[[int], list[int]], max_tokens: int) -> list[Req]:
    """`n` requests `{tag}-{i}` with `prompt(i)`, arriving as a Poisson process of `rate`/s from `rng` (None: all at
    once). Each prompt is drawn before its arrival gap, so a workload's draws come in one fixed order."""
    t, out = 0.0, []
    for i in range(n):
        out.append(Req(f"{tag}-{i}", prompt(i), max_tokens, t))
        if rate:
            t += rng.expovariate(rate)
    return out


@dataclass
class Trace:
    start: float = 0.0
    end: float = 0.0
    arrival: dict[str, float] = field(default_factory=dict)
    prompt_len: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)  # per request: time stamp of each output token
    steps: list[tuple[float, float]] = field(default_factory=list)  # engine steps: (start, end)
    stats: dict[str, float] = field(default_factory=dict)  # engine counters accumulated over this run

    def arrive(self, r: Req, t: float) -> None:
        self.arrival[r.rid] = t
        self.prompt_len[r.rid] = len(r.prompt)

    def record(self, rid: str, t: float, n: int = 1) -> None:
        self.tokens.setdefault(rid, []).extend([t] * n)

    @property
    def output_tokens(self) -> int:
        return sum(len(v) for v in self.tokens.values())

    def ttft(self, rid: str) -> float:
        return self.tokens[rid][0] - self.arrival[rid]


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class EngineSystem:
    """One Sluice configuration; the engine is built on first use and kept for the measured run."""

    def __init__(self, name: str, config: EngineConfig):
        self.name = name
        self.config = config
        self.engine: LLMEngine | None = None

    def run(self, reqs: list[Req], desc: str = "", progress: bool = True,
            on_step: Callable[[Trace, float], list[Req]] | None = None) -> Trace:
        if self.engine is None:
            self.engine = LLMEngine(self.config)
            # NOTE: as the server does once its engine is built: without it a full collection in a measured run held
            # a step for 168 ms (AMD EPYC, `neighbour`), a spike no served stream sees
            freeze_startup_heap()
        return drive(self.engine, reqs, desc or self.name, progress, on_step)

    def close(self) -> None:
        self.engine = None
        gc.unfreeze()  # (collectable again, this engine's cycles with the rest)


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps",
             "prompt_tokens_computed", "generation_tokens", "host_cache_hits", "host_copy_seconds", "deferred_decodes")


def calibrate_capacity(system: EngineSystem, warmup: list[Req], calibration: list[Req],
                       progress: bool = True) -> float:
    """Requests/s `system` serves when `calibration` arrives all at once, after `warmup` (a cold engine would time
    its first-call setup, not its capacity)."""
    system.run(warmup, desc="warm-up calibration", progress=progress)
    tr = system.run(calibration, desc="calibrating capacity", progress=progress)
    return len(calibration) / (tr.end - tr.start)


def drive(eng: LLMEngine, reqs: list[Req], desc: str, progress: bool = True,
          on_step: Callable[[Trace, float], list[Req]] | None = None) -> Trace:
    """Adds each request when its arrival time passes and steps the engine until all finish.

    `on_step(trace, now)` may return more requests, which arrive at `now` (event-triggered arrivals).
    """
    pending = sorted(reqs, key=lambda r: r.at)
    before = eng.stats()
    tr = Trace()
    total = sum(r.max_tokens for r in reqs)
    bar = tqdm(total=total, desc=desc, unit="tok", leave=False, disable=not progress)
    tr.start = t0 = time.perf_counter()
    i = 0
    while i < len(pending) or eng.has_unfinished():
        now = time.perf_counter()
        while i < len(pending) and t0 + pending[i].at <= now:
            r = pending[i]
            tr.arrive(r, t0 + r.at)
            eng.add_request(r.rid, r.prompt, r.params or sampling(r.max_tokens), client=r.client)
            i += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, t0 + pending[i].at - time.perf_counter()))
            continue
        s = time.perf_counter()
        outs = eng.step()
        t = time.perf_counter()
        tr.steps.append((s, t))
        n = 0
        for o in outs:
            if o.new_token_ids:
                tr.record(o.request_id, t, len(o.new_token_ids))
                n += len(o.new_token_ids)
        bar.update(n)
        if on_step is not None:
            for r in on_step(tr, t):
                tr.arrive(r, t)
                eng.add_request(r.rid, r.prompt, r.params or sampling(r.max_tokens), client=r.client)
                bar.total += r.max_tokens
    tr.end = time.perf_counter()
    bar.close()
    after = eng.stats()
    tr.stats = {k: after[k] - before[k] for k in COUNTERS}
    return tr


# -- metrics --------------------------------------------------------------------------------


def pct(xs: list[float] | np.ndarray, q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000.0 * x, 2)


def itls(tr: Trace, rids: list[str] | None = None,
         window: tuple[float, float] | None = None) -> list[float]:
    """Gaps between consecutive tokens of each stream; with `window`, only gaps that overlap it."""
    out: list[float] = []
    for rid in rids if rids is not None else tr.tokens:
        ts = tr.tokens.get(rid, [])
        for a, b in pairwise(ts):
            if window is None or (b > window[0] and a < window[1]):
                out.append(b - a)
    return out


def summarize(system: str, tr: Trace, rids: list[str] | None = None, **extra) -> dict:
    """A result row (docs/architecture.md §10 keys) over the whole trace; `extra` keys are appended."""
    rids = rids if rids is not None else list(tr.arrival)
    ttfts = [tr.ttft(r) for r in rids if tr.tokens.get(r)]
    gaps = itls(tr, rids)
    wall = tr.end - tr.start
    st = tr.stats
    q = st.get("prefix_cache_queries")
    row = {
        "system": system,
        "throughput_tok_s": round(tr.output_tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_ms": ms(pct(ttfts, 50)),
        "ttft_p99_ms": ms(pct(ttfts, 99)),
        "itl_p50_ms": ms(pct(gaps, 50)),
        "itl_p99_ms": ms(pct(gaps, 99)),
        "itl_max_ms": ms(max(gaps) if gaps else None),
        "prefix_hit_rate": round(st["prefix_cache_hits"] / q, 4) if q else None,
        "output_tokens": tr.output_tokens,
        "wall_s": round(wall, 3),
    }
    for k in ("prompt_tokens_computed", "num_steps", "num_preemptions"):
        if k in st:
            row[k] = st[k]
    row.update(extra)
    return row


def measure(systems: list, workload: Callable[[str], list[Req]], warmup: Callable[[str], list[Req]],
            row: Callable[[object, Trace], dict], rounds: int = 1,
            progress: bool = True) -> tuple[list[dict], dict[str, Trace]]:
    """Warms every system up once, then runs the measured workload `rounds` times, alternating systems
    (rotating the order each round); per system, the row (and trace) of its best-throughput round is kept:
    on a shared host, noise only ever slows a run down. The row's `rounds` holds every round's numbers,
    in round order, for ratios taken within a round (`report.paired_ratio`).

    `workload(tag)` / `warmup(tag)` build the requests (ids prefixed with `tag`); a system that raises
    gets a row with an `error` field instead of numbers, and the others still run.
    """
    errors: dict[str, str] = {}
    for s in systems:
        try:
            s.run(warmup(f"warm-{s.name}"), desc=f"warm-up {s.name}", progress=progress)
        except Exception as e:  # noqa: BLE001 — a broken baseline is a result, not a crash
            errors[s.name] = f"{type(e).__name__}: {e}"
    runs: dict[str, list[tuple[dict, Trace]]] = {s.name: [] for s in systems}
    for k in range(rounds):
        for s in systems[k % len(systems):] + systems[: k % len(systems)]:
            if s.name in errors:
                continue
            try:
                tr = s.run(workload(f"r{k}"), desc=s.name, progress=progress)
                runs[s.name].append((row(s, tr), tr))
            except Exception as e:  # noqa: BLE001
                errors[s.name] = f"{type(e).__name__}: {e}"
    rows, traces = [], {}
    for s in systems:
        if s.name in errors:
            rows.append(error_row(s.name, errors[s.name]))
            continue
        r, traces[s.name] = max(runs[s.name], key=lambda rt: rt[0]["throughput_tok_s"] or 0.0)
        rows.append(with_rounds(r, [rr for rr, _ in runs[s.name]]))
    return rows, traces


def with_rounds(best: dict, rounds: list[dict]) -> dict:
    """`best` plus `rounds`: each numeric key's value in every round, in round order (`report.paired_ratio`)."""
    numeric = [k for k, v in best.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {**best, "rounds": {k: [r.get(k) for r in rounds] for k in numeric}}


ROW_KEYS = ("system", "throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
            "prefix_hit_rate")


def error_row(system: str, error: str, **extra) -> dict:
    """A row for a system that could not be measured: every metric None, and why."""
    return {"system": system, **{k: None for k in ROW_KEYS[1:]}, **extra, "error": error}
