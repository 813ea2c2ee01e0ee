"""Loads a local Hugging Face model directory: config, safetensors weights (sharded too), tokenizer.

Nothing is downloaded: the tokenizer is opened with `local_files_only=True`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.config import GENERATION_KEYS
from engine.models import ARCHITECTURES, ModelConfig


def check_readable(model_dir: str | Path) -> None:
    """Raises FileNotFoundError or PermissionError naming the real cause, before anything is loaded: an
    unreadable file would otherwise surface as a missing one (a 0700 directory hides its config.json)."""
    d = Path(model_dir)
    uid = os.geteuid() if hasattr(os, "geteuid") else "?"
    try:
        os.stat(d)
    except PermissionError:
        raise PermissionError(f"model directory {d} cannot be reached by this process (uid {uid}): a directory "
                              f"above it is not searchable; `chmod a+x` on that directory") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"model directory {d} does not exist") from None
    if not d.is_dir():
        raise NotADirectoryError(f"model path {d} is not a directory")
    paths = [d]
    if os.access(d, os.R_OK | os.X_OK):
        entries = sorted(d.iterdir())
        dangling = [p.name for p in entries if p.is_symlink() and not p.exists()]
        if dangling:
            raise FileNotFoundError(f"model directory {d}: {', '.join(dangling[:3])} link to files that do not exist "
                                    "(an incomplete download or copy?)")
        paths += [p for p in entries if p.is_file()]
    unreadable = [p for p in paths if not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0))]
    if unreadable:
        def who(p: Path) -> str:
            st = p.stat()
            return f"{p.name if p != d else str(d)} (mode {st.st_mode & 0o777:04o}, owner uid {st.st_uid})"
        shown = ", ".join(who(p) for p in unreadable[:3]) + (f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else "")
        raise PermissionError(
            f"model directory {d} is not readable by this process (uid {uid}): {shown}. Make it readable, e.g. "
            f"`chmod -R a+rX` on it (in Docker: on the host directory mounted there)")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    check_readable(model_dir)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def load_model_config(model_dir: str | Path) -> ModelConfig:
    return ModelConfig.from_hf(read_config(model_dir))


def _weight_files(d: Path) -> list[str]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d}")
    return files


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read whole."""
    d = Path(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for f in _weight_files(d):
        weights.update(load_file(str(d / f)))
    return weights


class Weights:
    """A checkpoint's tensors by name, read when asked for: whole, or a range of rows or of columns, so a
    tensor-parallel rank reads (and holds in host memory) only its part (safetensors' slices read just those bytes).
    Each file is opened once (one mapping of it, as `load_file` makes), for as long as this object lives."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        self.where: dict[str, object] = {}  # tensor name -> the open file holding it
        for f in _weight_files(d):
            st = safe_open(str(d / f), "pt")
            self.where.update(dict.fromkeys(st.keys(), st))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dimension 0 (fewer where the tensor ends first)."""
        return self.where[name].get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of a 2-D tensor, contiguous (a copy, unless they are all of them)."""
        return self.where[name].get_slice(name)[:, start:stop].contiguous()


def auto_tokenizer() -> Any:
    """transformers' `AutoTokenizer`. Its import (~1 s on a small CPU) is what `load_tokenizer`, and unpickling a
    tokenizer, wait for: a process can call this early, beside other work."""
    from transformers import AutoTokenizer

    return AutoTokenizer


def preload_tokenizers() -> None:
    """Imports what `load_tokenizer` waits for besides the model's files: `AutoTokenizer`, and the config classes of
    the architectures the engine runs (AutoTokenizer reads the model's config; the first config class imported
    brings ~1.5 s of transformers' modules on a small CPU). For a process that will load a model later."""
    from transformers import CONFIG_MAPPING

    auto_tokenizer()
    for arch in ARCHITECTURES:
        try:
            CONFIG_MAPPING[arch.removesuffix("ForCausalLM").lower()]  # the lookup imports the class
        except KeyError:  # not in this transformers: the load says so, if such a model comes
            pass


def load_tokenizer(model_dir: str | Path):
    return auto_tokenizer().from_pretrained(str(model_dir), local_files_only=True)


def sampling_defaults(model_dir: str | Path, generation_config: str = "auto",
                      override: dict[str, Any] | None = None) -> dict[str, Any]:
    """Requests' sampling defaults as `SamplingParams` keyword arguments, as vLLM's `--generation-config` takes them:
    the `GENERATION_KEYS` a generation_config.json sets (the model's for "auto", the one in a directory, none for
    "vllm"), `override` over them; `max_new_tokens` becomes `max_tokens`, a cap on every request's. The rest of the
    file (`do_sample` among it, as vLLM) is not read. Raises ValueError for a file that is not a JSON object."""
    config: dict[str, Any] = {}
    if generation_config != "vllm":
        path = Path(model_dir if generation_config == "auto" else generation_config) / "generation_config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            if not isinstance(config, dict):
                raise ValueError(f"{path}: not a JSON object")
        elif generation_config != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {generation_config}")
    config = {**config, **(override or {})}
    out = {key: config[key] for key in GENERATION_KEYS if config.get(key) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


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
