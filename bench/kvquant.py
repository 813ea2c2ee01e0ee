"""kvquant: the KV cache stored as int8 or fp8 (`--kv-cache-dtype`) against the model's dtype: accuracy, then
capacity and speed.

Accuracy: per model (the embedded default, the benchmark model, and the four shapes the correctness tests build:
Llama GQA tied, Llama untied with llama3 rope, Qwen2 with biases, Qwen3 with q/k norm), `prompts` random prompts,
`output` greedy tokens each, with every step's logits kept, in float32: the reference is then exact, and what
moves is the cache's rounding alone (in bf16 the model's own rounding moves more: a float32 cache for a bf16 model
agreed with bf16's on 38-78% of tokens in a first run). Reported: the share of tokens equal to the float32 cache's
at the same position, the sequences equal throughout, the largest logit error while a sequence's tokens still
agree (the same context on both sides), and at each first difference the reference's top-two margin (a flipped
near-tie, or not). These random-weight models have many near-ties, so a control row stores the KV in bfloat16,
the usual 2-byte cache: what any rounding of the cache costs them. Then the attention kernels over a quantized cache against their torch twin, and the
twin against attention over the exact (fp32) cache: the kernels' own error, and the quantization's.

Capacity and speed: the same KV bytes for both (each pool's `num_kv_blocks` from them), sized so the model dtype's pool holds a
few of `chats` long requests that all arrive at once: a KV-bound workload. Reported: the blocks each pool holds,
throughput, preemptions, prompt tokens computed (recomputation after preemption).
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import report
from bench.common import Run, model_config
from bench.driver import EngineSystem, Req, measure, summarize
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.layout import kv_block_bytes
from engine.models import ModelConfig
from engine.tiny import default_model_dir, hf_shape_configs, write_hf_shape

QUANTIZED = ("int8", "fp8")


@dataclass(frozen=True)
class Sizes:
    prompts: int  # accuracy: prompts per model
    prompt_len: tuple[int, int]
    output: int  # accuracy: greedy tokens per prompt
    chats: int  # capacity: requests, all at once
    chat_prompt: int
    chat_output: int
    budget_blocks: int  # capacity: the KV byte budget, in the model dtype's blocks


FULL = Sizes(32, (32, 256), 64, 32, 256, 128, 96)
QUICK = Sizes(4, (16, 48), 8, 6, 48, 16, 12)


class _LogitTap:
    """Wraps an engine's sampler: keeps each sampled row's logits under (request id, output position)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def __getattr__(self, name):  # the engine reads the sampler's generator
        return getattr(self.sampler, name)

    def __call__(self, logits, reqs):
        for i, r in enumerate(reqs):
            self.rows[(r.request_id, r.num_output_tokens)] = logits[i].float().cpu()
        return self.sampler(logits, reqs)


def _greedy(model_dir: Path, kv_cache_dtype: str, prompts: list[list[int]], n: int):
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                 max_model_len=max(map(len, prompts)) + n, max_num_seqs=len(prompts)))
    tap = _LogitTap(eng.runner.sampler)
    eng.runner.sampler = tap
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs], [[tap.rows[(o.request_id, i)] for i in range(n)] for o in outs]


def accuracy_row(model: str, model_dir: Path, prompts: list[list[int]], sz: Sizes, ref, kv: str) -> dict:
    """`kv`'s greedy run over `prompts` against `ref`, the float32 cache's (`_greedy`)."""
    ref_tokens, ref_logits = ref
    tokens, logits = _greedy(model_dir, kv, prompts, sz.output)
    same = err = 0.0
    flips: list[float] = []
    whole = 0
    for t, r, lg, lr in zip(tokens, ref_tokens, logits, ref_logits):
        same += sum(a == b for a, b in zip(t, r))
        whole += t == r
        for i, (a, b) in enumerate(zip(t, r)):
            err = max(err, (lg[i] - lr[i]).abs().max().item())  # same context up to here
            if a != b:
                top2 = lr[i].topk(2).values
                flips.append((top2[0] - top2[1]).item())
                break
    return {"system": f"{model} {kv}", "model": model, "kv_cache_dtype": kv,
            "token_agreement": round(same / (len(tokens) * sz.output), 4),
            "sequences_identical": f"{whole}/{len(tokens)}",
            "max_logit_error": round(err, 4),
            "max_margin_at_a_flip": round(max(flips), 4) if flips else None}


def kernel_rows(run: Run) -> list[dict]:
    """The backend's paged attention over a quantized cache (q in the run's dtype) vs the twin in fp32 over the same
    cache (the kernel's own error), and that twin vs fp32 attention over the exact cache (the quantization's)."""
    import sluice_kernels as kernels
    from sluice_kernels import reference

    torch.manual_seed(run.seed)
    dtype = run.torch_dtype
    bs, H, Hkv, D = 16, 8, 4, 64
    q_lens, cached = [1] * 16 + [7, 40], [100 + 37 * i for i in range(16)] + [60, 200]
    need = [-(-(c + n) // bs) for c, n in zip(cached, q_lens)]
    nb = sum(need)
    tables = torch.zeros(len(need), max(need), dtype=torch.int32)
    perm, used = torch.randperm(nb), 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    k, v = torch.randn(nb, bs, Hkv, D) * 2, torch.randn(nb, bs, Hkv, D)
    q = torch.randn(sum(q_lens), H, D).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([c + n for c, n in zip(cached, q_lens)], dtype=torch.int32)
    exact = reference.paged_attention(q.float(), k, v, tables, cu, lens, D**-0.5)
    rows = []
    for kv in (torch.int8, torch.float8_e4m3fn):
        (kq, ks), (vq, vs) = (reference.quantize(c.view(-1, Hkv, D), kv) for c in (k, v))
        args = (q, kq.view(k.shape), vq.view(v.shape), tables, cu, lens, D**-0.5, ks.view(nb, bs, Hkv),
                vs.view(nb, bs, Hkv))
        twin = reference.paged_attention(q.float(), *args[1:])
        rows.append({"system": f"attention {str(kv).removeprefix('torch.')} ({kernels.attention_backend(q.device, dtype, kv)})",
                     "kernel_vs_twin_max_abs": round((kernels.paged_attention(*args).float() - twin).abs().max().item(), 5),
                     "twin_vs_exact_cache_max_abs": round((twin - exact).abs().max().item(), 5)})
    return rows


def main(run: Run) -> dict:
    sz = QUICK if run.quick else FULL
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvquant-") as tmp:
        models = {"embedded": default_model_dir()}
        if run.model_dir.resolve() != models["embedded"].resolve():
            models[run.model_dir.name] = run.model_dir
        if not run.quick:
            for name in hf_shape_configs():
                write_hf_shape(hf_shape_configs()[name], Path(tmp) / name, default_model_dir())
                models[name] = Path(tmp) / name
        for model, path in models.items():
            rng, vocab = run.rng(f"kvquant:{model}"), model_config(path)["vocab_size"]
            prompts = [run.tokens(rng, rng.randint(*sz.prompt_len), vocab) for _ in range(sz.prompts)]
            ref = _greedy(path, "auto", prompts, sz.output)
            for kv in (*QUANTIZED, "bfloat16"):
                rows.append(accuracy_row(model, path, prompts, sz, ref, kv))
    rows += kernel_rows(run)

    cfg = model_config(run.model_dir)
    mc = ModelConfig.from_hf(cfg)
    budget = sz.budget_blocks * kv_block_bytes(mc, 16, run.torch_dtype)  # the same bytes on any device
    vocab = cfg["vocab_size"]

    def chats(tag: str, n: int, prompt: int, output: int) -> list[Req]:
        rng = run.rng(f"kvquant:{tag}")
        return [Req(f"{tag}-{i}", run.tokens(rng, prompt, vocab), output, 0.0) for i in range(n)]

    systems = [EngineSystem(kv, EngineConfig(
        model=str(run.model_dir), dtype=run.dtype, kv_cache_dtype=kv, max_num_seqs=sz.chats, seed=run.seed,
        num_kv_blocks=budget // kv_block_bytes(mc, 16, run.torch_dtype if kv == "auto" else torch.int8),
        max_model_len=sz.chat_prompt + sz.chat_output)) for kv in ("auto", "int8")]
    speed, _ = measure(
        systems,
        workload=lambda tag: chats(tag, sz.chats, sz.chat_prompt, sz.chat_output),
        warmup=lambda tag: chats(tag, 2, 32, 4),
        row=lambda s, tr: summarize(s.name, tr, kv_blocks=s.engine.layout.num_blocks),
        rounds=run.rounds, progress=run.progress,
    )
    for r in speed:
        r["system"] = f"{r['system']} ({run.dtype if r['system'] == 'auto' else r['system']}), same KV bytes"
    rows += speed
    by = {r["system"].split()[0]: r for r in speed}
    control = {r["model"]: r["token_agreement"] for r in rows if r.get("kv_cache_dtype") == "bfloat16"}
    acc = [r["token_agreement"] / control[r["model"]] for r in rows if r.get("kv_cache_dtype") == "int8"]
    targets = [
        report.target("KV blocks in the same bytes, int8 / model dtype",
                      report.ratio(by["int8"].get("kv_blocks"), by["auto"].get("kv_blocks")), ">=", 1.8),
        report.target("throughput int8 / model dtype (KV-bound)",
                      report.ratio(by["int8"].get("throughput_tok_s"), by["auto"].get("throughput_tok_s")), ">=", 1.0),
        report.target("int8 token agreement / a bfloat16 cache's, worst model", round(min(acc), 3), ">=", 0.9),
    ]
    def plot():
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 1]})
        names = list(dict.fromkeys(r["model"] for r in rows if "model" in r))
        for j, (kv, color) in enumerate((("bfloat16", "#999999"), ("int8", "#4c72b0"), ("fp8", "#dd8452"))):
            vals = [next(r["token_agreement"] for r in rows if r.get("model") == m and r["kv_cache_dtype"] == kv)
                    for m in names]
            left.bar([i + 0.28 * j for i in range(len(names))], vals, 0.28, color=color, label=kv)
        left.set_xticks([i + 0.28 for i in range(len(names))], names, rotation=20, ha="right", fontsize=7)
        left.set_ylabel("greedy tokens equal to float32 KV's")
        left.set_ylim(0, 1.05)
        left.legend(fontsize=8, loc="lower right")
        right.bar(["model dtype", "int8"], [by["auto"].get("throughput_tok_s") or 0, by["int8"].get("throughput_tok_s") or 0],
                  color=["#999999", "#4c72b0"])
        right.set_ylabel("tok/s, same KV bytes")
        fig.suptitle(f"kvquant: accuracy on {sz.prompts} prompts x {sz.output} tokens; {sz.chats} chats of "
                     f"{sz.chat_prompt}+{sz.chat_output} tokens", fontsize=9)
        return fig

    report.write(run, "kvquant", rows,
                 columns=["token_agreement", "sequences_identical", "max_logit_error", "max_margin_at_a_flip",
                          "kernel_vs_twin_max_abs", "twin_vs_exact_cache_max_abs", "kv_blocks", "throughput_tok_s",
                          "num_preemptions", "prompt_tokens_computed", "wall_s", "error"],
                 config={**asdict(sz), "kv_bytes": budget}, targets=targets, plot=plot)
    return {"rows": rows, "targets": targets}
