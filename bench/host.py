"""host: how much of an engine step is host work, outside the model's forward (issue 15: on a GPU the forward
takes a fraction of the step; this part can be measured, and improved, on a CPU).

A decode-only batch of `batch` requests steps `steps` times (after warm-up steps), greedy or with temperature
0.8 and top-p 0.9. Each phase is timed by wrapping the engine's own functions: `schedule`, `prepare` (the
step's metadata), `forward` (the model: on a CPU its kernels), `sample`, and the rest of the step (`outputs`:
committing, detokenizing, stop checks, building each RequestOutput). Host time = step wall time - forward.
Rows give medians per step; `host_us_per_seq` divides the host time by the batch. The `sorted` and `looped` rows
run the same steps with the sampler as it was before issue 15 (a full-vocabulary sort for top-k/top-p, one
exponential draw per request in a Python loop; penalties with tensors and kernels of their own per request),
swapped in for this run: the baseline, measured side by side. The `penalties` rows decode greedily with
repetition 1.1, presence 0.5 and frequency 0.3 penalties; the `seeded` rows sample as the top-p rows with a seed per
request, their baseline drawing each seeded row's uniform with a call of its own. The `async outputs`
rows run the greedy steps with `async_output_proc` (a step's outputs made while the next step's forward runs on
the forward thread): their host time is what the forward does not hide. The `async scheduling` rows schedule and
launch each step before the last one's tokens are known (`async_scheduling`): the forward then runs on the forward
thread beside the engine thread's whole step, so only their step time means something (the phases overlap).

The `served (bridge)` rows are the host work the engine's rows leave out: the real server (`python -m service`, a
process of its own) streams `batch` WebSocket chats of `BRIDGE_TOKENS` greedy tokens each, and the CPU time of its
event-loop thread, from the moment every chat is sent to the last `done`, is divided by the engine steps and by the
tokens delivered in that window. That thread takes each step's outputs from the engine thread and turns them into
socket writes (handles, frames, JSON, WebSocket framing, the `send` system calls); it holds the GIL the engine thread
needs when the engine is a thread of the server (`--no-engine-process`), so on a GPU, where the forward is short,
its time adds to the step's. The `served (bridge, engine process)` rows run the same with the engine in a process of
its own (`--engine-process`, the default): there a reader thread takes each step's results off the pipe (its
unpickling is not in `loop_ms`), and the two processes' host work overlaps. Both report the served step (wall time
over engine steps), its median inter-token latency and tokens per second; the target compares the two hosts' steps
at the largest batch. The client runs in this process, at the lowest priority.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

import engine.sampler
from bench import report
from bench.common import Run, model_config
from bench.driver import itls, ms, pct
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampler import filter_logits

PHASES = ("schedule", "prepare", "forward", "sample")


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    warmup_steps: int
    steps: int
    prompt: int


FULL = Sizes((1, 64, 256), 4, 16, 16)
QUICK = Sizes((1, 8), 1, 3, 8)
BRIDGE_TOKENS = {FULL: 64, QUICK: 4}  # per chat in the `served (bridge)` rows


class _Timed:
    """Calls `fn`, adding its wall time to `spent[name]`; other attributes pass through to `obj` (if any)."""

    def __init__(self, fn, spent: dict[str, float], name: str, obj=None):
        self.fn, self.spent, self.name, self.obj = fn, spent, name, obj

    def __getattr__(self, attr):
        return getattr(self.obj, attr)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.spent[self.name] += time.perf_counter() - t


def sorted_draw(logits, params, gens, default) -> torch.Tensor:
    """The sampler before issue 15, the baseline: temperature, the sort-based filter, then an exponential race with
    one `exponential_` call per request. (Its filter now also groups ties: one O(V) pass more than the old one.)"""
    dev, V = logits.device, logits.shape[1]
    sub = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    sub = filter_logits(sub, torch.tensor([min(p.top_k, V) for p in params], device=dev),
                        torch.tensor([p.top_p for p in params], device=dev),
                        torch.tensor([p.min_p for p in params], device=dev),
                        use_top_k_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
                        use_min_p=any(p.min_p > 0 for p in params))
    probs = sub.softmax(-1)
    noise = torch.empty_like(probs)
    for j, g in enumerate(gens):
        noise[j].exponential_(generator=g or default)
    return (probs / noise).argmax(-1)


def looped_penalties(logits: torch.Tensor, reqs: list) -> None:
    """The penalties before issue 15's batching, the baseline: per request with penalties, its own tensors and
    kernels (a bincount, a mask over the vocabulary, three elementwise ops)."""
    V = logits.shape[1]
    for i, r in enumerate(reqs):
        p = r.params
        if not p.has_penalties:
            continue
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(r.token_ids, dtype=torch.long, device=logits.device)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if out.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out, minlength=V)[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def looped_uniforms(gens, default, device) -> torch.Tensor:
    """The seeded draws before issue 15's batching, the baseline: a call (a kernel) and a write per seeded row."""
    u = torch.empty(len(gens), device=device)
    rest = [j for j, g in enumerate(gens) if g is None]
    if rest:
        u[rest] = torch.rand(len(rest), generator=default, device=device)
    for j, g in enumerate(gens):
        if g is not None:
            u[j] = g.rand(1, device)[0]
    return u


def measure_batch(run: Run, sz: Sizes, batch: int, params: SamplingParams, baseline: bool = False,
                  loop: str = "") -> dict:
    """`loop`: "" (the plain step loop), "async outputs" or "async scheduling" (`EngineConfig`'s overlaps)."""
    vocab = model_config(run.model_dir)["vocab_size"]
    eng = LLMEngine(EngineConfig(model=str(run.model_dir), dtype=run.dtype, max_num_seqs=max(batch, 1),
                                 max_num_batched_tokens=max(2048, batch * sz.prompt), seed=run.seed,
                                 max_model_len=sz.prompt + sz.warmup_steps + sz.steps + 80,
                                 async_output_proc=loop == "async outputs", async_scheduling=loop == "async scheduling"))
    spent = dict.fromkeys((*PHASES, "step"), 0.0)
    eng.scheduler.schedule = _Timed(eng.scheduler.schedule, spent, "schedule")
    eng.runner._tokens = _Timed(eng.runner._tokens, spent, "prepare")
    eng.runner._metadata = _Timed(eng.runner._metadata, spent, "prepare")
    eng.runner.model.forward = _Timed(eng.runner.model.forward, spent, "forward")
    sampler = eng.runner.sampler
    eng.runner.sampler = _Timed(sampler, spent, "sample", sampler)
    rng = run.rng(f"host:{batch}")
    n = sz.warmup_steps + sz.steps
    for i in range(batch):
        eng.add_request(f"r{i}", run.tokens(rng, sz.prompt, vocab), replace(params, max_tokens=n + 64, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in eng.requests.values()):
        eng.step()  # the prompts (their first tokens come out here)
    for _ in range(sz.warmup_steps):
        eng.step()
    per_step: list[dict[str, float]] = []
    current = engine.sampler.draw, engine.sampler.apply_penalties, engine.sampler._uniforms
    if baseline:
        engine.sampler.draw, engine.sampler.apply_penalties = sorted_draw, looped_penalties
        if params.seed is not None:  # the seeded rows: only the draws differ from the batched sampler's
            engine.sampler.draw, engine.sampler._uniforms = current[0], looped_uniforms
    try:
        for _ in range(sz.steps):
            before = dict(spent)
            t = time.perf_counter()
            outs = eng.step()
            wall = time.perf_counter() - t
            assert sum(len(o.new_token_ids) for o in outs) == batch, "a step that is not one decode per request"
            phases = {k: spent[k] - before[k] for k in PHASES}
            per_step.append({**phases, "step": wall, "outputs": wall - sum(phases.values())})
    finally:
        engine.sampler.draw, engine.sampler.apply_penalties, engine.sampler._uniforms = current
    med = {k: statistics.median(s[k] for s in per_step) for k in (*PHASES, "step", "outputs")}
    host = statistics.median(s["step"] - s["forward"] for s in per_step)
    ms = lambda x: round(1000 * x, 3)  # noqa: E731
    eng.close()
    kind = ("penalties" if params.has_penalties else "greedy" if params.temperature == 0
            else "top-p seeded" if params.seed is not None else "top-p")
    before = {"penalties": " (looped)", "top-p": " (sorted)", "top-p seeded": " (looped)"}.get(kind, "") if baseline else ""
    name = f"batch {batch} {kind}{before}{f' ({loop})' if loop else ''}"
    row = {"system": name, "batch": batch,
           "step_ms": ms(med["step"]), "forward_ms": ms(med["forward"]), "host_ms": ms(host),
           "host_us_per_seq": round(1e6 * host / batch, 1), "host_share": round(host / med["step"], 3),
           "schedule_ms": ms(med["schedule"]), "prepare_ms": ms(med["prepare"]), "sample_ms": ms(med["sample"]),
           "outputs_ms": ms(med["outputs"])}  # medians of per-step values: each phase's is at most the step's
    if loop == "async scheduling":  # the forward and sampling run beside the step's other phases: only its time counts
        row.update(dict.fromkeys(("forward_ms", "host_ms", "host_us_per_seq", "host_share", "sample_ms", "outputs_ms")))
    return row


def main_thread_cpu_s(pid: int) -> float:
    """CPU time process `pid`'s main thread has run, in seconds (Linux: the scheduler's nanosecond count)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def measure_bridge(run: Run, sz: Sizes) -> list[dict]:
    """The `served (bridge)` rows (module docstring): two servers, started together, one with its engine on a thread
    and one with it in a process of its own (`--engine-process`); `run.rounds` rounds of each server in turn (the
    other idle) at each batch size, keeping each row's round of the shortest served step."""
    from transformers import AutoTokenizer

    from bench.serve import Chat, Server, run_server

    b_max, tokens = max(sz.batches), BRIDGE_TOKENS[sz]
    tok = AutoTokenizer.from_pretrained(str(run.model_dir))
    vocab = model_config(run.model_dir)["vocab_size"]
    flags = ["--max-num-seqs", str(b_max), "--max-num-batched-tokens", str(max(2048, b_max * 64)),
             "--max-model-len", str(256 + tokens), "--seed", str(run.seed)]
    servers: dict[str, Server] = {}
    best: dict[str, dict] = {}
    try:
        for host, flag in (("bridge", "--no-engine-process"), ("bridge, engine process", "--engine-process")):
            servers[host] = Server(run, flags + [flag], probe=False)
        for server in servers.values():
            server.wait_ready()
        for _ in range(run.rounds):
            for host, server in servers.items():
                pid = server.proc.pid  # its main thread runs the event loop
                for batch in sz.batches:
                    rng = run.rng(f"host:bridge:{batch}")
                    chats = [Chat(f"b{batch}-{i}", [], tokens, messages=[
                        {"role": "user", "content": tok.decode(run.tokens(rng, sz.prompt, vocab))}])
                        for i in range(batch)]
                    start: dict[str, float] = {}

                    def on_start() -> None:  # every chat connected, none sent
                        start.update(server.counters(), cpu=main_thread_cpu_s(pid))

                    trace = run_server(server, chats, f"{host}@{batch}", run.progress, on_start=on_start)
                    cpu, end = main_thread_cpu_s(pid) - start["cpu"], server.counters()
                    steps, delivered = end["num_steps"] - start["num_steps"], trace.output_tokens
                    assert delivered == batch * tokens, f"{delivered} tokens delivered of {batch * tokens}"
                    wall = trace.end - trace.start
                    row = {"system": f"batch {batch} served ({host})", "batch": batch,
                           "loop_ms": round(1000 * cpu / steps, 3),
                           "loop_us_per_token": round(1e6 * cpu / delivered, 1),
                           "step_ms": round(1000 * wall / steps, 3), "itl_p50_ms": ms(pct(itls(trace), 50)),
                           "tok_s": round(delivered / wall, 1), "steps": int(steps), "tokens": delivered}
                    if row["system"] not in best or row["step_ms"] < best[row["system"]]["step_ms"]:
                        best[row["system"]] = row
    finally:
        for server in servers.values():
            server.stop()
    return list(best.values())


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    greedy, top_p = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=None)
    penalties = SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)
    seeded = replace(top_p, seed=1234)
    rows = []
    rank = lambda r: r["step_ms"] if r["host_ms"] is None else r["host_ms"]  # noqa: E731  (the lower, the better round)
    for batch in sz.batches:
        for params, baseline, loop in ((greedy, False, ""), (greedy, False, "async outputs"),
                                       (greedy, False, "async scheduling"), (top_p, True, ""), (top_p, False, ""),
                                       (penalties, True, ""), (penalties, False, ""), (seeded, True, ""),
                                       (seeded, False, "")):
            best = None
            for _ in range(run.rounds):  # the fastest round: noise only ever slows a step down
                row = measure_batch(run, sz, batch, params, baseline, loop)
                best = row if best is None or rank(row) < rank(best) else best
            rows.append(best)
    rows += measure_bridge(run, sz)
    by = {r["system"]: r for r in rows}
    b = max(sz.batches)

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.6))
        names = [r["system"] for r in rows]
        bottom = [0.0] * len(rows)
        for key, color in (("schedule_ms", "#4c72b0"), ("prepare_ms", "#55a868"), ("sample_ms", "#c44e52"),
                           ("outputs_ms", "#8172b2"), ("loop_ms", "#937860")):
            vals = [r.get(key) or 0.0 for r in rows]  # (none for async scheduling: its phases overlap)
            ax.bar(names, vals, bottom=bottom, color=color, label=key.removesuffix("_ms"))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("host ms per step (forward excluded)")
        ax.tick_params(axis="x", labelsize=7, rotation=20)
        ax.legend(fontsize=8)
        ax.set_title(f"host: {run.model_dir.name}, {run.dtype}; median of {sz.steps} decode steps", fontsize=9)
        return fig

    targets = [report.target(f"host ms per batch-{b} top-p step / the sorted sampler's",
                             report.ratio(by[f"batch {b} top-p"]["host_ms"], by[f"batch {b} top-p (sorted)"]["host_ms"]),
                             "<=", 0.333),
               report.target(f"host ms per batch-{b} penalties step / the looped penalties'",
                             report.ratio(by[f"batch {b} penalties"]["host_ms"],
                                          by[f"batch {b} penalties (looped)"]["host_ms"]), "<=", 0.333),
               report.target(f"served batch-{b} step ms, engine process / engine thread",
                             report.ratio(by[f"batch {b} served (bridge, engine process)"]["step_ms"],
                                          by[f"batch {b} served (bridge)"]["step_ms"]), "<=", 1.0)]
    report.write(run, "host", rows,
                 columns=["step_ms", "forward_ms", "host_ms", "host_us_per_seq", "host_share", "schedule_ms",
                          "prepare_ms", "sample_ms", "outputs_ms", "loop_ms", "loop_us_per_token",
                          "itl_p50_ms", "tok_s"],
                 config=asdict(sz), targets=targets, plot=plot)
    return {"rows": rows, "targets": targets}
