"""Shared fixtures: the embedded tiny model (built once under $SLUICE_HOME)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("SLUICE_QUIET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from engine.tiny import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def bos_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer that, as Llama's, puts a BOS (here `<|endoftext|>`) before every text it
    tokenizes with its special tokens."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("bos-model")
    for f in tiny_model_dir.iterdir():
        (out / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy(f, out / f.name)
    tok = json.loads((out / "tokenizer.json").read_text())
    bos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|endoftext|>")
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos],
                                                                  "tokens": ["<|endoftext|>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


@pytest.fixture(scope="session")
def main_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The `sluice serve` that tests/service and tests/hostile share (flags: tests/service/conftest.py)."""
    from tests.server import start_server
    from tests.service.conftest import MAIN_FLAGS

    server = start_server(tmp_path_factory.mktemp("main-server"), *MAIN_FLAGS)
    yield server
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log_text()[-4000:]}"
