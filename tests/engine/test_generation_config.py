"""Requests' sampling defaults from the model's generation config (vLLM's `--generation-config` /
`--override-generation-config`): engine/loader.py `sampling_defaults`, `LLMEngine.default_sampling_params`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import sampling_defaults

QWEN_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "pad_token_id": 2,
             "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "transformers_version": "4.37"}


def model_with(tiny: Path, out: Path, generation_config: dict | None) -> Path:
    out.mkdir()
    for f in tiny.iterdir():
        (out / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy(f, out / f.name)
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config))
    return out


def test_the_sampling_keys_are_read_and_max_new_tokens_is_max_tokens(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN_LIKE, "max_new_tokens": 512, "min_p": None}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                           "max_tokens": 512}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path, "vllm", {"temperature": 0.5}) == {"temperature": 0.5}
    # the override goes over the file's keys; a null unsets one
    assert sampling_defaults(tmp_path, "auto", {"top_k": None, "min_p": 0.05}) == {
        "temperature": 0.7, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.05, "max_tokens": 512}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    assert sampling_defaults(tmp_path, str(other)) == {"temperature": 0.2}  # a directory's file instead
    assert sampling_defaults(other.parent / "none-here") == {}  # auto, and the model has none: no defaults
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(tmp_path, str(tmp_path / "x"))
    (other / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        sampling_defaults(tmp_path, str(other))


def test_engine_config_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a directory"):
        EngineConfig(generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not temprature"):
        EngineConfig(override_generation_config={"temprature": 0.5})


def test_a_request_without_params_gets_the_models_defaults(tiny_model_dir: Path, tmp_path: Path) -> None:
    """top_k 1 makes any temperature greedy, and max_new_tokens 6 the length: the defaults applied, by construction."""
    model = model_with(tiny_model_dir, tmp_path / "m", {**QWEN_LIKE, "top_k": 1, "temperature": 1.0,
                                                           "max_new_tokens": 6})
    eng = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, max_model_len=256))
    try:
        assert eng.default_sampling_params() == SamplingParams(temperature=1.0, top_p=0.8, top_k=1,
                                                               repetition_penalty=1.05, max_tokens=6)
        prompt = [5, 17, 33, 9]
        out = eng.generate([prompt])[0]
        greedy = eng.generate([prompt], SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=6))[0]
        assert len(out.token_ids) == 6 and out.token_ids == greedy.token_ids
        # explicit params are the caller's own, whole (the engine API has no "unset")
        assert len(eng.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0))[0].token_ids) == 9
    finally:
        eng.close()
    plain = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, max_model_len=256,
                                   generation_config="vllm", override_generation_config={"max_new_tokens": 3}))
    try:
        assert plain.default_sampling_params() == SamplingParams(max_tokens=3)
    finally:
        plain.close()


def test_a_default_sampling_params_refuses_fails_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = model_with(tiny_model_dir, tmp_path / "m", {"top_p": 1.5})
    with pytest.raises(ValueError, match="generation config's sampling defaults.*top_p"):
        LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64, max_model_len=256))
