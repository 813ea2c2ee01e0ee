"""Fixtures of the engine tests."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="session")
def draft_dir(tiny_model_dir, tmp_path_factory):
    """A draft model that agrees with the tiny model often, not always: its weights, one layer's MLP perturbed."""
    out = tmp_path_factory.mktemp("draft") / "draft"
    shutil.copytree(tiny_model_dir, out)
    w = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    name = "model.layers.3.mlp.down_proj.weight"
    w[name] = w[name] + torch.randn(w[name].shape, generator=g) * w[name].std() * 0.8
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
