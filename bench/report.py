"""Writes a workload's results: `WORKLOAD.json` (docs/architecture.md §10), `WORKLOAD.md` (table + targets), `WORKLOAD.png`.

A full (non-quick) run into the default results folder also refreshes that workload's section of
bench/README.md, between `<!-- results:WORKLOAD -->` markers, so the README always shows the latest run.
"""
from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display
import matplotlib.pyplot as plt
import numpy as np

from bench.common import RESULTS_DIR, Run, host_line

README = Path(__file__).parent / "README.md"


def target(name: str, value: float | None, op: str, bound: float) -> dict:
    """One target of issue 6: `value op bound`, e.g. ratio >= 3."""
    met = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return {"name": name, "value": None if value is None else round(value, 3), "op": op, "bound": bound, "met": met}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def paired_ratio(a: dict, b: dict, key: str) -> float | None:
    """The median over rounds of row a's `key` / row b's `key` in the same round (`driver.measure` rows).

    A round runs the systems back to back, so a ratio within a round cancels the shared host's slow
    swings in speed (2x between minutes here), which a ratio of each system's best round does not.
    """
    xs, ys = a.get("rounds", {}).get(key) or [], b.get("rounds", {}).get(key) or []
    rs = [x / y for x, y in zip(xs, ys) if x is not None and y]
    return statistics.median(rs) if rs else None


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 1 else f"{v:,.1f}"
    return str(v)


def gap_panels(names: Sequence[str], row_height: float):
    """A figure of one panel per system, stacked, sharing their axes, for `draw_gaps`; returns (fig, axes)."""
    fig, axes = plt.subplots(len(names), 1, figsize=(8, row_height * len(names) + 0.8), sharex=True, sharey=True)
    axes = [axes] if len(names) == 1 else list(axes)
    for ax in axes:
        ax.set_yscale("log")
        ax.set_ylabel("ITL ms", fontsize=8)
    return fig, axes


def draw_gaps(ax, ts: Sequence[float], origin: float, **style) -> None:
    """A stream's inter-token gaps (token time stamps `ts`), each a segment over the time it lasted (seconds after
    `origin`) at its height in ms."""
    ax.hlines([1000 * (b - a) for a, b in zip(ts, ts[1:])], [a - origin for a in ts[:-1]],
              [b - origin for b in ts[1:]], color="#4c72b0", lw=1.2, **style)


def cdf_figure(series: Sequence[tuple[str, Sequence[float], str]], xlabel: str, title: str, log_x: bool = False):
    """One step line per (label, values, color): the fraction of chats whose value is at most x."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, values, color in series:
        x = np.sort(np.asarray(values, dtype=float))
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=color, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of chats")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return fig


def ttft_cdf(traces: dict, rows: dict[str, dict], colors: Sequence[tuple[str, str]], title: str):
    """`cdf_figure` of the time to first token of each system in `colors` (name, color) that has a trace."""
    series = [(f"{name} (p50 {rows[name]['ttft_p50_ms']:,.0f} ms)",
               [1000 * traces[name].ttft(r) for r in traces[name].arrival if traces[name].tokens.get(r)], color)
              for name, color in colors if name in traces]
    return cdf_figure(series, "time to first token, ms (log)", title, log_x=True)


def markdown(result: dict, columns: list[str]) -> str:
    rows = result["rows"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        cells = [_fmt(r.get(c)) if c != "error" or not r.get(c) else str(r[c])[:80] for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    if result.get("targets"):
        lines += ["", "| target | value | bound | met |", "|---|---|---|---|"]
        for t in result["targets"]:
            met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            lines.append(f"| {t['name']} | {_fmt(t['value'])} | {t['op']} {t['bound']} | {met} |")
    cfg = result.get("config", {})
    host = result.get("host", {})
    lines += ["", f"Command: `{result.get('command')}`  ", f"Config: `{json.dumps(cfg, sort_keys=True)}`  ",
              f"Host: {host_line(host)}; "
              f"{result.get('timestamp')}" + (" (--quick)" if result.get("quick") else "")]
    return "\n".join(lines) + "\n"


def write(run: Run, workload: str, rows: list[dict], *, columns: list[str], config: dict, targets: list[dict],
          plot, extra: dict | None = None) -> Path:
    """`plot(ax_or_fig_factory)` draws the workload's figure; returns the JSON path."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "workload": workload,
        "model": run.model_dir.name,
        "rows": rows,
        "targets": targets,
        "config": config,
        "host": run.host(),
        "quick": run.quick,
        "command": run.command,
        "rounds": run.rounds,
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
        **(extra or {}),
    }
    path = run.out_dir / f"{workload}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    md = markdown(result, ["system", *[c for c in columns if c != "system"]])
    (run.out_dir / f"{workload}.md").write_text(f"# {workload}\n\n{md}")
    fig = plot()
    fig.savefig(run.out_dir / f"{workload}.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    if not run.quick and run.out_dir.resolve().parent == RESULTS_DIR.resolve():
        _refresh_readme(workload, md, f"results/{run.out_dir.name}/{workload}.png")
    return path


def _refresh_readme(workload: str, md: str, png: str) -> None:
    if not README.exists():
        return
    text = README.read_text()
    begin, end = f"<!-- results:{workload} -->", f"<!-- /results:{workload} -->"
    if begin not in text or end not in text:
        return
    block = f"{begin}\n{md}\n![{workload}]({png})\n{end}"
    README.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.DOTALL))
