"""Trains Sluice's embedded default model: a small Llama that answers questions about Python in readable text,
learnt from the documentation every CPython install carries (PSF licence): `pydoc_data.topics` (the language
reference's topics) and the docstrings of a fixed list of standard-library modules.

    python -m engine.train --out DIR          # ~40 min on 2 cores; resumable: run it again to go on
    python -m engine.train --out DIR --ask    # its answers to README's held-out questions
    python -m engine.train --out DIR --eval   # its held-out losses

The chats it learns from (all built here, deterministically):
- a user asks about a topic or section ("Explain the "for" statement.") and the assistant answers with its text,
  "Go on." asking for the next part;
- a user asks what a function, class or method does and the assistant answers with its docstring;
- copying: the user pastes a paragraph and asks for it quoted back, or with one word replaced by another.

Held out from training: every chat whose key hashes into the held-out share (their answers give the held-out
loss) and the objects in HELD_OUT_OBJECTS (never seen at all). The same seed, Python version (the text comes from
the interpreter) and thread count give the same weights. DIR gets the model in Hugging Face format (bf16
safetensors, the project's byte-level BPE tokenizer with the ChatML template) and `train.json` with what was
run and measured.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import importlib
import json
import math
import os
import platform
import random
import re
import sys
import textwrap
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SEQ = 512  # training window, in tokens
CHAT_CHARS = 1400  # a chat is cut before it outgrows the window (~3.5 characters a token)
HELD_OUT_SHARE = 0.04

# Standard-library modules whose public docstrings become questions and answers.
DOC_MODULES = (
    "builtins", "abc", "argparse", "array", "base64", "bisect", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "enum", "fnmatch", "fractions", "functools", "glob", "hashlib", "heapq",
    "html", "inspect", "io", "itertools", "json", "logging", "math", "operator", "os", "os.path", "pathlib",
    "pickle", "queue", "random", "re", "shutil", "socket", "statistics", "string", "struct", "subprocess", "sys",
    "tempfile", "textwrap", "threading", "time", "typing", "urllib.parse", "uuid", "zipfile",
)
# Never trained on: README's held-out questions ask about these.
HELD_OUT_OBJECTS = ("textwrap.dedent", "os.path.splitext", "statistics.median", "str.zfill", "heapq.nsmallest")

TOPIC_QUESTIONS = ("Tell me about {t}.", "Explain {t}.", "What does the documentation say about {t}?",
                   "How does {t} work?", "What is {t}?")
OBJECT_QUESTIONS = ("What does `{t}` do?", "Explain `{t}`.", "How do I use `{t}`?", "What is `{t}` for?")
# Phrasings never used in training, for the held-out questions in README.
HELD_OUT_TOPIC_QUESTION = "Can you describe {t}?"
HELD_OUT_OBJECT_QUESTION = "Could you explain what `{t}` is?"
MORE = ("Go on.", "Continue.", "What else?", "Tell me more.")
COPY_ASKS = ("Quote this back to me exactly:", "Repeat this text:", "Copy this:")
# README's held-out questions: phrasings never trained on, about topics it learnt and objects it never saw
HELD_OUT_QUESTIONS = (
    *(HELD_OUT_TOPIC_QUESTION.format(t=t) for t in ('the "while" statement', 'the "with" statement', "lambdas",
                                                     'the "import" statement', "slicings")),
    *(HELD_OUT_OBJECT_QUESTION.format(t=t) for t in HELD_OUT_OBJECTS),
)


@dataclass
class Chat:
    key: str  # stable name: decides held-out membership
    messages: list[dict[str, str]]


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def _chunks(text: str, limit: int) -> list[str]:
    """Paragraphs grouped into pieces of at most `limit` characters (a longer paragraph is its own piece, cut)."""
    out, cur = [], ""
    for p in _paragraphs(text):
        if cur and len(cur) + 2 + len(p) > limit:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{p}" if cur else p
        while len(cur) > limit:
            cut = cur.rfind("\n", 0, limit)
            cut = cut if cut > limit // 2 else limit
            out.append(cur[:cut].rstrip())
            cur = cur[cut:].lstrip("\n")
    if cur:
        out.append(cur)
    return out


def _sections(topic: str) -> list[tuple[str, str]]:
    """A pydoc topic split at its headings (a line underlined with *, = or -): (title, body) pairs."""
    lines = topic.split("\n")
    heads = [i for i in range(len(lines) - 1)
             if lines[i].strip() and re.fullmatch(r"([*=\-])\1{2,}", lines[i + 1].strip())
             and abs(len(lines[i + 1].strip()) - len(lines[i].strip())) <= 2]
    out = []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        body = "\n".join(lines[i + 2:end]).strip("\n")
        if len(body) > 40:
            out.append((lines[i].strip(), body))
    return out


def _as_subject(title: str) -> str:
    return title[0].lower() + title[1:] if title.startswith(("The ", "A ", "An ")) else title


def topic_chats(rng: random.Random) -> list[Chat]:
    import pydoc_data.topics

    chats = []
    for name in sorted(pydoc_data.topics.topics):
        for s, (title, body) in enumerate(_sections(pydoc_data.topics.topics[name])):
            subject = _as_subject(title)
            parts = _chunks(body, 700)
            i = 0
            while i < len(parts):
                if i == 0:
                    msgs = [{"role": "user", "content": rng.choice(TOPIC_QUESTIONS).format(t=subject)}]
                else:  # a long section goes on in a chat of its own, picked up where the last one stopped
                    tail = parts[i - 1].strip().split("\n")[-1].strip()
                    msgs = [{"role": "user", "content": f'In the documentation of {subject}, what comes after "{tail}"?'}]
                size = len(msgs[0]["content"])
                while i < len(parts) and (len(msgs) == 1 or size + len(parts[i]) < CHAT_CHARS):
                    if len(msgs) > 1:
                        msgs.append({"role": "user", "content": rng.choice(MORE)})
                    msgs.append({"role": "assistant", "content": parts[i]})
                    size += len(parts[i]) + 20
                    i += 1
                chats.append(Chat(f"topic:{name}:{s}:{i}", msgs))
    return chats


def _documented(module: str):
    """(qualified name, signature or "", docstring) for a module's public functions, classes and methods."""
    mod = importlib.import_module(module)
    prefix = "" if module == "builtins" else module + "."
    for name in sorted(vars(mod)):
        obj = vars(mod)[name]
        if name.startswith("_") or getattr(obj, "__module__", module) not in (module, mod.__name__):
            continue
        if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
            continue
        yield from _entry(prefix + name, obj)
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                m = vars(obj)[meth]
                # (another library's patch of a class, e.g. transformers' Logger.warning_once, is not its doc)
                if not meth.startswith("_") and callable(m) and getattr(m, "__module__", None) in (None, mod.__name__):
                    yield from _entry(f"{prefix}{name}.{meth}", m)


def _entry(qualname: str, obj):
    doc = inspect.getdoc(obj) or ""
    if len(doc) < 60:
        return
    try:
        sig = str(inspect.signature(obj))
        if "<" in sig:  # a default's repr: addresses, live objects (logging.shutdown's handlers): not reproducible
            sig = ""
    except (TypeError, ValueError):
        sig = ""
    yield qualname, sig, doc


def object_chats(rng: random.Random) -> tuple[list[Chat], dict[str, str]]:
    """Docstring chats, and the held-out objects' reference answers."""
    chats, held, seen = [], {}, set()
    for module in DOC_MODULES:
        for qualname, sig, doc in _documented(module):
            if qualname in seen:
                continue
            seen.add(qualname)
            head = f"`{qualname}{sig}`\n\n" if sig and not doc.startswith(qualname.split(".")[-1] + "(") else ""
            answer = _chunks(head + doc, CHAT_CHARS - 100)[0]
            if qualname in HELD_OUT_OBJECTS:
                held[qualname] = answer
                continue
            q = rng.choice(OBJECT_QUESTIONS).format(t=qualname)
            chats.append(Chat(f"object:{qualname}", [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": answer}]))
    return chats, held


def copy_chats(rng: random.Random, sources: list[Chat]) -> list[Chat]:
    """Quote a pasted paragraph back, or with every occurrence of one word replaced by another."""
    paras = sorted({p for c in sources for m in c.messages if m["role"] == "assistant"
                    for p in _paragraphs(m["content"]) if 80 <= len(p) <= 600})
    words = sorted({w for p in paras for w in re.findall(r"\b[a-z]{4,}\b", p)})
    chats = []
    for n, p in enumerate(paras):
        if rng.random() < 0.5:
            q = rng.choice(COPY_ASKS)
            msgs = [{"role": "user", "content": f"{q}\n\n{p}"}, {"role": "assistant", "content": p}]
        else:
            here = sorted(set(re.findall(r"\b[a-z]{4,}\b", p)))
            if not here:
                continue
            a, b = rng.choice(here), rng.choice(words)
            msgs = [{"role": "user", "content": f'Replace "{a}" with "{b}" in this text:\n\n{p}'},
                    {"role": "assistant", "content": re.sub(rf"\b{a}\b", b, p)}]
        chats.append(Chat(f"copy:{n}", msgs))
    return chats


def scrambled_chats(rng: random.Random, sources: list[Chat], n: int) -> list[Chat]:
    """Copying that memory cannot do: `n` paragraphs with their words shuffled, quoted back, or with a word
    replaced, or (a second turn) the first line of the assistant's own earlier answer quoted. A fine-tuning phase's
    data (`--scrambled`): the documentation alone teaches little copying, as most of what it asks to copy can
    be recalled instead."""
    paras = sorted({p for c in sources for m in c.messages if m["role"] == "assistant"
                    for p in _paragraphs(m["content"]) if 80 <= len(p) <= 600})
    chats = []
    for i in range(n):
        words = rng.choice(paras).split()
        rng.shuffle(words)
        text = textwrap.fill(" ".join(words), 70)
        shape = rng.random()
        if shape < 0.5:
            msgs = [{"role": "user", "content": f"{rng.choice(COPY_ASKS)}\n\n{text}"},
                    {"role": "assistant", "content": text}]
        elif shape < 0.8:
            here = sorted(set(re.findall(r"\b[a-z]{4,}\b", text))) or ["the"]
            a, b = rng.choice(here), rng.choice(words).strip(".,:;()\"'") or "value"
            msgs = [{"role": "user", "content": f'Replace "{a}" with "{b}" in this text:\n\n{text}'},
                    {"role": "assistant", "content": re.sub(rf"\b{re.escape(a)}\b", lambda _: b, text)}]
        else:
            first = text.split("\n")[0]
            msgs = [{"role": "user", "content": "Tell me about this text."}, {"role": "assistant", "content": text},
                    {"role": "user", "content": f"Quote this back to me exactly:\n\n{first}"},
                    {"role": "assistant", "content": first}]
        chats.append(Chat(f"scrambled:{i}", msgs))
    return chats


def held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32 < HELD_OUT_SHARE


def corpus(seed: int = 0, scrambled: int = 0) -> tuple[list[Chat], list[Chat], dict[str, str]]:
    """(training chats, held-out chats, held-out objects' answers), the same for the same seed and Python; with
    `scrambled` copying chats (`scrambled_chats`) added."""
    rng = random.Random(seed)
    topics = topic_chats(rng)
    with warnings.catch_warnings():  # reading some modules' members warns (typing.re is deprecated)
        warnings.simplefilter("ignore", DeprecationWarning)
        objects, held_objects = object_chats(rng)
    chats = topics + objects + copy_chats(rng, topics) + scrambled_chats(random.Random(seed + 1), topics, scrambled)
    return [c for c in chats if not held_out(c.key)], [c for c in chats if held_out(c.key)], held_objects


def render(messages: list[dict[str, str]]) -> str:
    """The chat template's text (engine/tiny.py CHAT_TEMPLATE), without the generation prompt."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def encode(tokenizer, chats: list[Chat]) -> list[tuple[list[int], list[bool]]]:
    """Each chat as (token ids, which ids are the assistant's answer and its <|im_end|>), cut to the window."""
    out = []
    for c in chats:
        text, spans = "", []
        for m in c.messages:
            text += f"<|im_start|>{m['role']}\n"
            if m["role"] == "assistant":
                spans.append((len(text), len(text) + len(m["content"]) + len("<|im_end|>")))
            text += f"{m['content']}<|im_end|>\n"
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        answer = [any(a <= lo and hi <= b for a, b in spans) for lo, hi in enc["offset_mapping"]]
        out.append((enc["input_ids"][:SEQ], answer[:SEQ]))
    return out


def pack(encoded: list[tuple[list[int], list[bool]]], order: list[int], pad: int):
    """Chats laid end to end in `order` into rows of SEQ tokens (a chat never split across rows), padded."""
    rows, cur = [], []
    for i in order:
        ids = encoded[i][0]
        if len(cur) + len(ids) > SEQ:
            rows.append(cur + [pad] * (SEQ - len(cur)))
            cur = []
        cur = cur + ids
    if cur:
        rows.append(cur + [pad] * (SEQ - len(cur)))
    return torch.tensor(rows)


@dataclass
class Args:
    out: str
    steps: int = 700
    batch: int = 16
    lr: float = 1.5e-3
    warmup: int = 40
    seed: int = 0
    vocab: int = 4096
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    intermediate_size: int = 1024
    threads: int = 2
    save_every: int = 25
    tokenizer: str = ""  # a model directory whose tokenizer to use (a draft model's target's); "": train one
    init: str = ""  # a model directory (of these sizes) to go on from: a second phase; its tokenizer too
    scrambled: int = 0  # copying chats of shuffled words added to the data (`scrambled_chats`)


def model_config(a: Args, tokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
        "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.hidden_size // a.num_attention_heads, "intermediate_size": a.intermediate_size,
        "vocab_size": len(tokenizer), "initializer_range": 0.02,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"), "bos_token_id": None,
    }


def lr_at(a: Args, step: int) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def batch_rows(rows_of_epoch, step: int, batch: int) -> torch.Tensor:
    """Rows step*batch .. step*batch+batch of the endless sequence of epochs (each epoch a fresh packing)."""
    out, want, pos = [], batch, step * batch
    while want:
        epoch, n = 0, pos
        while n >= len(rows_of_epoch(epoch)):
            n -= len(rows_of_epoch(epoch))
            epoch += 1
        take = rows_of_epoch(epoch)[n:n + want]
        out.append(take)
        want -= len(take)
        pos += len(take)
    return torch.cat(out)


@torch.no_grad()
def held_out_loss(model, encoded) -> float:
    """Mean cross-entropy (nats per token) over the held-out chats' answer tokens."""
    model.eval()
    total, count = 0.0, 0
    for ids, answer in encoded:
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0, :-1].float()
        mask = torch.tensor(answer[1:])
        loss = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
        total += float(loss[mask].sum())
        count += int(mask.sum())
    model.train()
    return total / max(1, count)


def train(a: Args, progress: bool = True, stop_after: int | None = None) -> Path | None:
    """Trains (or goes on from DIR/train-state.pt) and writes the model into `a.out`. With `stop_after`, it stops
    once the state of that step is saved, and returns None: run it again to go on."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.layout import cpu_model
    from engine.tiny import build_tokenizer

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    train_chats, eval_chats, held_objects = corpus(a.seed, a.scrambled)
    texts = [render(c.messages) for c in train_chats]
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    if a.tokenizer or a.init:  # a draft model shares its target's tokenizer, ids and all; a second phase its first's
        from engine.loader import load_tokenizer

        tokenizer = load_tokenizer(Path(a.tokenizer or a.init))
    else:
        tokenizer = build_tokenizer(a.vocab, a.seed, texts)
    encoded = encode(tokenizer, train_chats)
    eval_encoded = encode(tokenizer, eval_chats)
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg = model_config(a, tokenizer)

    cache: dict[int, torch.Tensor] = {}

    def rows_of_epoch(epoch: int) -> torch.Tensor:
        if epoch not in cache:
            order = list(range(len(encoded)))
            random.Random(a.seed * 1000 + epoch).shuffle(order)
            cache[epoch] = pack(encoded, order, pad)  # kept: `batch_rows` walks the epochs from the first
        return cache[epoch]

    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa")).float()
    if a.init:
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(
            {k: v.float() for k, v in load_file(str(Path(a.init) / "model.safetensors")).items()}, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise SystemExit(f"{a.init} is not a model of these sizes: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state_path, step, seconds = out / "train-state.pt", 0, 0.0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if {**state["args"], "out": a.out, "save_every": a.save_every} != asdict(a) or state["corpus"] != digest:
            raise SystemExit(f"{state_path} was written with other arguments or another corpus; remove it to start over")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step, seconds = state["step"], state["seconds"]
    tokens = sum(len(ids) for ids, _ in encoded)
    bar = tqdm(total=a.steps, initial=step, desc="training", unit="step", disable=not progress)
    model.train()
    losses: list[float] = []
    while step < a.steps:
        t0 = time.perf_counter()
        x = batch_rows(rows_of_epoch, step, a.batch)
        labels = x.masked_fill(x == pad, -100)
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step)
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seconds += time.perf_counter() - t0
        losses.append(float(loss.detach()))
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", epoch=f"{step * a.batch / len(rows_of_epoch(0)):.1f}")
        if step % a.save_every == 0 or step == a.steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"args": asdict(a), "corpus": digest, "model": model.state_dict(), "optim": opt.state_dict(),
                        "step": step, "seconds": seconds}, tmp)
            os.replace(tmp, state_path)
            if stop_after is not None and step >= stop_after:
                bar.close()
                return None
    bar.close()

    eval_loss = held_out_loss(model, [e for c, e in zip(eval_chats, eval_encoded) if not c.key.startswith("scrambled:")])
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}  # tied to the embedding
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    report = {
        "args": {k: v for k, v in asdict(a).items() if k != "out"},
        "python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_model(),
        "corpus_sha256": digest, "train_chats": len(train_chats), "held_out_chats": len(eval_chats),
        "train_tokens_per_epoch": tokens, "epochs": round(a.steps * a.batch / len(rows_of_epoch(0)), 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_loss_last_50_steps": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4) if losses else None,
        "held_out_answer_loss": round(eval_loss, 4), "train_seconds": round(seconds),
        "held_out_objects": sorted(held_objects),
    }
    (out / "train.json").write_text(json.dumps(report, indent=2) + "\n")
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)
    state_path.unlink(missing_ok=True)
    return out


def evaluate(model_dir: str, seed: int = 0) -> dict[str, float]:
    """Held-out answer losses (nats per token) of a trained model: on the documentation's held-out chats (what
    README reports), and on held-out copying of shuffled words (`scrambled_chats`: can it copy from its context?)."""
    from transformers import AutoModelForCausalLM

    from engine.loader import load_tokenizer

    tokenizer = load_tokenizer(Path(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _, held, _ = corpus(seed, scrambled=2000)
    docs = [c for c in held if not c.key.startswith("scrambled:")]
    copies = [c for c in held if c.key.startswith("scrambled:")]
    return {"held_out_answer_loss": round(held_out_loss(model, encode(tokenizer, docs)), 4),
            "held_out_scrambled_copy_loss": round(held_out_loss(model, encode(tokenizer, copies)), 4)}


def ask(model: str | None, max_tokens: int = 120) -> str:
    """The held-out questions' answers from `model` (default: the embedded one), greedy and at temperature 0.7
    (seed 0), as README shows them: markdown, unedited."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=model))
    prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in HELD_OUT_QUESTIONS]
    greedy = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    warm = eng.generate(prompts, [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i)
                                  for i in range(len(prompts))])
    out = []
    for q, g, w in zip(HELD_OUT_QUESTIONS, greedy, warm):
        out.append(f"**{q}**\n")
        for label, o in (("greedy", g), ("temperature 0.7", w)):
            cut = "" if o.finish_reason == "stop" else f" *[cut at {max_tokens} tokens]*"
            body = "\n".join("    " + line for line in o.text.strip("\n").split("\n"))
            out.append(f"*{label}:*{cut}\n\n{body}\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Args(out="")
    ap.add_argument("--out", required=True, help="directory for the model (and train-state.pt while it runs)")
    for field, value in asdict(defaults).items():
        if field != "out":
            ap.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--ask", action="store_true",
                    help="print the held-out questions' answers from the model in --out (README's) and exit")
    ap.add_argument("--eval", action="store_true", help="print the held-out losses of the model in --out and exit")
    ap.add_argument("--stop-after", type=int, metavar="STEP",
                    help="stop once the state of this step is saved (train in sittings: run again to go on)")
    ns = vars(ap.parse_args(argv))
    progress, stop_after = not ns.pop("no_progress"), ns.pop("stop_after")
    if ns.pop("ask"):
        print(ask(ns["out"]))
        return
    if ns.pop("eval"):
        print(json.dumps(evaluate(ns["out"])))
        return
    out = train(Args(**ns), progress=progress, stop_after=stop_after)
    print(out if out is not None else f"stopped; {Path(ns['out']) / 'train-state.pt'} holds the state")


if __name__ == "__main__":
    sys.exit(main())
