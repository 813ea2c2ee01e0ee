"""spec: speculative decoding (engine/spec.py) on the embedded default model (trained, engine/train.py; this workload
always runs it, whatever --model says), off and with each method, side by side: `ngram` (prompt lookup) and `draft`
(`engine/sluice-chat-draft`, a 2-layer model trained by the same script on the same data and tokenizer).

Two chat workloads, greedy:
- `copy`: answers that repeat text: the user pastes a paragraph and asks for it quoted back, or with one word
  replaced (paragraphs from the training script's held-out chats, so the model has not learnt them), or asks a
  question again after the model's own first answer to it (greedy, made before the clock starts).
- `ask`: questions whose answers are not in the prompt (the held-out questions): the control, where drafts are rare.

Each at batch 1 (one chat at a time) and batch 64 (all at once, `max_num_seqs` 64). Rows: tokens/s off and on
(the speedup is the median over rounds of the ratio within a round), the draft tokens proposed per output token, the
share of them accepted, and whether the outputs were identical (they must be: greedy). `batch 64 (forced)` lifts
`speculative_disable_by_batch_size` to show what drafting would cost there.
"""
from __future__ import annotations

import functools
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import report
from bench.common import Run
from engine import EngineConfig, LLMEngine, SamplingParams


@dataclass(frozen=True)
class Sizes:
    batch1_chats: int
    batch64_chats: int
    max_tokens: int


FULL = Sizes(12, 64, 160)
QUICK = Sizes(4, 4, 24)  # batch 1 takes the same 4 chats: 2 of them need not quote a thing in 24 tokens


@functools.cache
def _corpus():
    """The training script's chats (engine/train.py `corpus`: half a second to build, and each workload reads it)."""
    from engine.train import corpus

    return corpus(0)


def chats(kind: str, n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` chats of a workload, from the training script's held-out material."""
    from engine.train import (HELD_OUT_OBJECT_QUESTION, HELD_OUT_OBJECTS, HELD_OUT_TOPIC_QUESTION, OBJECT_QUESTIONS,
                              TOPIC_QUESTIONS, _paragraphs)

    train, held, _ = _corpus()
    subjects = sorted({c.key.split(":")[1] for c in train if c.key.startswith("object:")})[::40]
    subjects = [f"`{s}`" for s in subjects] + ['the "for" statement', 'the "try" statement', 'the "if" statement',
                                               'the "while" statement', "lambdas", "slicings"]
    rng = random.Random(f"{seed}:spec:{kind}")
    paras = sorted({p for c in held for m in c.messages if m["role"] == "assistant"
                    for p in _paragraphs(m["content"]) if 120 <= len(p) <= 500})
    out: list[list[dict[str, str]]] = []
    while len(out) < n:
        if kind == "ask":
            if rng.random() < 0.5:
                q = HELD_OUT_OBJECT_QUESTION.format(t=rng.choice(HELD_OUT_OBJECTS))
            else:
                q = HELD_OUT_TOPIC_QUESTION.format(t=rng.choice(["the \"while\" statement", "the \"with\" statement",
                                                                  "lambdas", "the \"import\" statement", "slicings"]))
            out.append([{"role": "user", "content": q}])
            continue
        p = rng.choice(paras)
        shape = len(out) % 3
        if shape == 0:
            out.append([{"role": "user", "content": f"Quote this back to me exactly:\n\n{p}"}])
        elif shape == 1:
            words = sorted(set(re.findall(r"\b[a-z]{4,}\b", p))) or ["the"]
            a, b = rng.choice(words), rng.choice(["value", "object", "name", "result"])
            out.append([{"role": "user", "content": f'Replace "{a}" with "{b}" in this text:\n\n{p}'}])
        else:  # asked again: the first answer (the model's own, filled in by `main`) is in the context
            subject = rng.choice(subjects)
            q = (OBJECT_QUESTIONS if subject.startswith("`") else TOPIC_QUESTIONS)[0].format(t=subject.strip("`"))
            out.append([{"role": "user", "content": q}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": q}])
    return out


DRAFT = Path(__file__).resolve().parents[1] / "engine" / "sluice-chat-draft"
METHODS = {"ngram": "ngram", "draft": f"draft:{DRAFT}"}


def measure(run: Run, prompts: list[list[int]], batch: int, max_tokens: int, speculative: str | None,
            disable_at: int = 16) -> dict:
    from engine.config import default_model_dir as chat_model_dir

    eng = LLMEngine(EngineConfig(model=str(chat_model_dir()), dtype=run.dtype, max_num_seqs=batch, seed=run.seed,
                                 speculative=speculative, speculative_disable_by_batch_size=disable_at))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up (kernels, allocator)
    before = eng.stats()
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    seconds = time.perf_counter() - t
    st = eng.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = st["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = st["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"tok_s": tokens / seconds, "tokens": tokens, "steps": st["num_steps"] - before["num_steps"],
            "drafts_per_token": drafts / tokens, "acceptance": accepted / drafts if drafts else None,
            "outputs": [o.token_ids for o in outs]}


def main(run: Run) -> dict:
    from engine.config import default_model_dir as chat_model_dir

    sz = QUICK if run.quick else FULL
    rows, ratios = [], {}
    cases = [(kind, b, n, forced) for kind in ("copy", "ask")
             for b, n, forced in ((1, sz.batch1_chats, False), (64, sz.batch64_chats, False), (64, sz.batch64_chats, True))]
    answers = LLMEngine(EngineConfig(model=str(chat_model_dir()), dtype=run.dtype))  # first answers; its tokenizer
    tok = answers.processor
    for kind, batch, n, forced in cases:
        disable = batch + 1 if forced else 16  # the engine's default, or never
        convs = chats(kind, n, run.seed)
        for c in convs:  # asked again: the model's own first answer
            if len(c) == 3:
                c[1]["content"] = answers.generate([tok.chat_ids(c[:1])], SamplingParams(
                    max_tokens=sz.max_tokens, temperature=0.0))[0].text
        prompts = [tok.chat_ids(c) for c in convs]
        per_round = []
        for _ in range(run.rounds):  # off and on back to back: a ratio within a round cancels the host's swings
            per_round.append({m: measure(run, prompts, batch, sz.max_tokens, spec, disable)
                              for m, spec in {"off": None, **METHODS}.items()})
        off = max((r["off"] for r in per_round), key=lambda r: r["tok_s"])
        for method in METHODS:
            on = max((r[method] for r in per_round), key=lambda r: r["tok_s"])
            name = f"{kind}, batch {batch}{' (forced)' if forced else ''}, {method}"
            ratio = statistics.median(r[method]["tok_s"] / r["off"]["tok_s"] for r in per_round)
            ratios[name] = ratio
            rows.append({"system": name, "chats": n, "tok_s_off": round(off["tok_s"], 1),
                         "tok_s_on": round(on["tok_s"], 1), "speedup": round(ratio, 3), "steps_off": off["steps"],
                         "steps_on": on["steps"], "drafts_per_token": round(on["drafts_per_token"], 3),
                         "acceptance": None if on["acceptance"] is None else round(on["acceptance"], 3),
                         "identical": all(r[method]["outputs"] == r["off"]["outputs"] for r in per_round)})

    def plot():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.4))
        names = [r["system"] for r in rows]
        ax.bar(names, [r["speedup"] for r in rows], color=["#55a868" if r["speedup"] >= 1 else "#c44e52" for r in rows])
        ax.axhline(1.0, color="#333", lw=0.8)
        ax.set_ylabel("tok/s with ngram speculation / without")
        ax.tick_params(axis="x", labelsize=7, rotation=20)
        ax.set_title(f"spec: {chat_model_dir().name}, {run.dtype}, greedy, {sz.max_tokens} tokens max", fontsize=9)
        return fig

    targets = [report.target(f"{kind}, batch {b}, {m}: tok/s with speculation / without", ratios[f"{kind}, batch {b}, {m}"],
                             ">=", bound)
               for m in METHODS for kind, b, bound in (("copy", 1, 1.5), ("copy", 64, 0.95), ("ask", 1, 0.95))]
    for r in rows:
        if not r["identical"]:
            r["error"] = "greedy outputs differ with speculation"
    report.write(run, "spec", rows,
                 columns=["chats", "tok_s_off", "tok_s_on", "speedup", "steps_off", "steps_on", "drafts_per_token",
                          "acceptance", "identical"],
                 config=asdict(sz), targets=targets, plot=plot)
    return {"rows": rows, "targets": targets}
