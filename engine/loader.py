"""Loads a local Hugging Face model directory: config, safetensors weights (sharded too), tokenizer.

Nothing is downloaded: the tokenizer is opened with `local_files_only=True`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.models import ModelConfig


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def load_model_config(model_dir: str | Path) -> ModelConfig:
    return ModelConfig.from_hf(read_config(model_dir))


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(d / f)))
    return weights


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def eos_token_ids(model_dir: str | Path, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, merged."""
    ids: set[int] = set()
    sources = [read_config(model_dir)]
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        e = src.get("eos_token_id")
        ids.update(e if isinstance(e, list) else [] if e is None else [e])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
