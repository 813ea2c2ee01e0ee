"""Builds the tests' and benchmarks' models: seeded random llama weights + a byte-level BPE tokenizer with ChatML
special tokens and chat template, written in Hugging Face format (the embedded default model is a trained one:
engine/train.py). Also the project's tokenizer builder (`build_tokenizer`).

`python -m engine.tiny --preset tiny|small --out DIR`. Deterministic for a given seed, so every
machine builds the same model; the real loading path (`engine/loader.py`) always runs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from engine.config import sluice_home

VERSION = 1  # bump when the build output changes, so cached copies are rebuilt
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    # loads in well under a second; the test model
    "tiny": dict(vocab=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=384),
    # ~50M parameters; the benchmark model
    "small": dict(vocab=8192, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=2048),
}

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "ng", "st"]
_EXTRA = ["the", "a", "and", "of", "to", "in", "is", "you", "that", "it", "model", "token", "cache",
          "stream", "chat", "prompt", "hello", "world", "café", "naïve", "日本語", "中文", "😀", "🚀", "ü"]


def _corpus(seed: int, n_words: int) -> list[str]:
    """Deterministic pseudo-text with a Zipf-like word distribution, some digits, punctuation, CJK, emoji."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(6000)] + _EXTRA
    weights = [1.0 / (i + 1) for i in range(len(words))]
    lines, line = [], []
    for w in rng.choices(words, weights, k=n_words):
        line.append(w.capitalize() if not line else w)
        if rng.random() < 0.08:
            line[-1] += rng.choice([".", ",", "!", "?", ":", ";"])
        if rng.random() < 0.02:
            line.append(str(rng.randint(0, 9999)))
        if rng.random() < 0.06:
            lines.append(" ".join(line))
            line = []
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0, texts: Iterable[str] | None = None):
    """A byte-level BPE tokenizer with the ChatML specials and chat template, trained on `texts` (default: the
    seeded pseudo-text corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, 40 * vocab_size) if texts is None else texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=1 << 20,
    )


def random_weights(cfg: dict[str, Any], seed: int, dtype: torch.dtype = torch.float32, progress: bool = True) -> dict[str, torch.Tensor]:
    """Llama-layout weights (HF names). Scales keep greedy choices far from ties yet varied."""
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    w = {"model.embed_tokens.weight": rnd(V, H, std=1.0), "model.norm.weight": torch.ones(H, dtype=dtype)}
    for i in tqdm(range(cfg["num_hidden_layers"]), desc="weights", unit="layer", disable=not progress):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(H, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=dtype)
        w[p + "self_attn.q_proj.weight"] = rnd(q, H, std=H**-0.5)
        w[p + "self_attn.k_proj.weight"] = rnd(kv, H, std=H**-0.5)
        w[p + "self_attn.v_proj.weight"] = rnd(kv, H, std=H**-0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(H, q, std=q**-0.5)
        w[p + "mlp.gate_proj.weight"] = rnd(I, H, std=H**-0.5)
        w[p + "mlp.up_proj.weight"] = rnd(I, H, std=H**-0.5)
        w[p + "mlp.down_proj.weight"] = rnd(H, I, std=2 * I**-0.5)
    if not cfg.get("tie_word_embeddings", True):
        w["lm_head.weight"] = rnd(V, H, std=3 * H**-0.5)  # logits with std ~3: peaked, not degenerate
    return w


def hf_shape_configs() -> dict:
    """Small transformers configs of the architectures the engine serves, for tests/engine/test_correctness.py and
    `bench kvquant`: Llama GQA with tied embeddings, Llama untied with llama3 rope and one KV head, Qwen2 (q/k/v
    biases), Qwen3 (q/k norm). Vocabulary 1,024: the tiny model's tokenizer fits them."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  initializer_range=0.1, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    return {
        "llama-gqa-tied": LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **common),
        "llama-untied-llama3rope": LlamaConfig(
            num_key_value_heads=1, tie_word_embeddings=False, head_dim=32,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 128, "rope_theta": 50000.0}, **common),
        "qwen2-bias": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common),
        "qwen3-qknorm": Qwen3Config(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, **common),
    }


def write_hf_shape(config, out: Path, tokenizer_dir: Path, seed: int = 1234):
    """A transformers model of `config` (e.g. one of `hf_shape_configs()`) with random weights from `seed`, saved
    in Hugging Face format under `out` with `tokenizer_dir`'s tokenizer files; returns the model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    model.save_pretrained(out)
    copy_tokenizer(tokenizer_dir, out)
    return model


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of one model directory into another."""
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)


def write_model(out_dir: str | Path, config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
                tokenizer_vocab: int = 1024, progress: bool = True) -> Path:
    """Writes config.json, model.safetensors and a trained tokenizer; the model's vocab_size is the tokenizer's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(total=3, desc=f"building {out.name}", unit="step", disable=not progress) as bar:
        tokenizer = build_tokenizer(tokenizer_vocab, seed)
        tokenizer.save_pretrained(str(out))
        bar.update()
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
            **config,
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "bos_token_id": None,
        }
        bar.update()
        save_file(random_weights(cfg, seed, dtype, progress=False), str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        bar.update()
    for f in out.iterdir():  # NOTE: safetensors writes 0600; a copy into a Docker bind mount must stay readable
        if f.is_file():
            f.chmod(0o644)
    return out


def build(preset: str, out_dir: str | Path, seed: int = 0, progress: bool = True) -> Path:
    p = dict(PRESETS[preset])
    vocab = p.pop("vocab")
    return write_model(out_dir, p, seed, tokenizer_vocab=vocab, progress=progress)


def default_model_dir(preset: str = "tiny") -> Path:
    """A preset's model under $SLUICE_HOME, built once (atomically: concurrent builders are safe)."""
    target = sluice_home() / "models" / f"sluice-{preset}-v{VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(preset, tmp, progress=os.environ.get("SLUICE_QUIET") is None)
        tmp.chmod(0o755)  # mkdtemp made it 0700
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", required=True, help="directory to write the model into")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = build(args.preset, args.out, args.seed)
    print(path)


if __name__ == "__main__":
    main()
