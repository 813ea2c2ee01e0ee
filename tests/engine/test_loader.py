"""Model directory loading: sharded safetensors, tokenizer + chat template, clear errors; tiny builder."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import load_weights
from engine.models import ModelConfig
from engine.tiny import PRESETS, random_weights


def test_sharded_checkpoint_loads_and_matches_single_file(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / f, tmp_path / f)
    single = load_weights(tiny_model_dir)
    sharded = load_weights(tmp_path)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64)).generate(["hello there"], params)
    b = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=64)).generate(["hello there"], params)
    assert a[0].token_ids == b[0].token_ids


def test_chat_template_and_eos(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    ids = eng.apply_chat_template([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    text = eng.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert eng.tokenizer.convert_tokens_to_ids("<|im_end|>") in eng.eos_token_ids


def test_unsupported_architecture_is_a_clear_error(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLMEngine(EngineConfig(model=str(tmp_path / "m")))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_bad_config_values_are_rejected():
    with pytest.raises(ValueError, match="scheduling"):
        EngineConfig(scheduling="fifo")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)


def test_small_preset_is_about_50m_params():
    p = dict(PRESETS["small"])
    vocab = p.pop("vocab")
    cfg = {**p, "vocab_size": vocab, "tie_word_embeddings": False}
    w = random_weights(cfg, seed=0, dtype=torch.bfloat16, progress=False)
    n = sum(t.numel() for t in w.values())
    assert 40e6 <= n <= 65e6, n
    mc = ModelConfig.from_hf({**cfg, "architectures": ["LlamaForCausalLM"]})
    assert mc.num_kv_heads < mc.num_heads  # GQA in the benchmark model


def test_tiny_build_is_deterministic(tmp_path):
    from engine.tiny import build

    a = build("tiny", tmp_path / "a", seed=3, progress=False)
    b = build("tiny", tmp_path / "b", seed=3, progress=False)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wb = load_weights(a), load_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
