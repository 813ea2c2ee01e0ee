"""Model directory loading: sharded safetensors, tokenizer + chat template, clear errors; tiny builder."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import Weights, check_readable, load_model_config, load_weights
from engine.models import ModelConfig
from engine.tiny import PRESETS, copy_tokenizer, random_weights


def test_sharded_checkpoint_loads_and_matches_single_file(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    copy_tokenizer(tiny_model_dir, tmp_path)
    single = load_weights(tiny_model_dir)
    sharded = load_weights(tmp_path)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
    lazy = Weights(tmp_path)  # what the model reads: whole, or a tensor-parallel rank's rows / columns only
    assert set(lazy.where) == set(single) and all(k in lazy for k in single) and "no.such.tensor" not in lazy
    for k, t in single.items():
        assert torch.equal(lazy.get(k), t) and torch.equal(lazy.rows(k, 3, 7), t[3:7])
        if t.dim() == 2:
            assert torch.equal(lazy.cols(k, 5, 9), t[:, 5:9]) and lazy.rows(k, t.shape[0] - 2, t.shape[0] + 5).shape[0] == 2
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


# ---- a model directory this process cannot read -----------------------------------------------------
def _as_another_user(fn, *args) -> str:
    """`fn(*args)` in a forked child, as uid/gid 65534 when we are root (root reads any file): its error, if any."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain os calls only, then _exit
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                fn(*args)
                msg = "no error"
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 1 << 16):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return out.decode()


@pytest.fixture
def model_copy(tiny_model_dir):
    d = Path(tempfile.mkdtemp(prefix="sluice-perm-"))  # not under pytest's 0700 tmp root: the other user must reach it
    try:
        d.chmod(0o755)
        for f in tiny_model_dir.iterdir():
            shutil.copy(f, d / f.name)
            (d / f.name).chmod(0o644)
        yield d
    finally:
        shutil.rmtree(d)


def test_readable_model_passes_the_check(model_copy):
    assert _as_another_user(check_readable, model_copy) == "no error"


def test_unreadable_weights_are_a_permission_error_that_names_the_fix(model_copy):
    (model_copy / "model.safetensors").chmod(0o600 if os.geteuid() == 0 else 0o000)  # 0600: what safetensors writes
    msg = _as_another_user(load_model_config, model_copy)
    assert msg.startswith("PermissionError: ") and "model.safetensors (mode 0" in msg, msg
    assert "chmod -R a+rX" in msg and "config.json" not in msg  # only the file it cannot read is named


def test_unreadable_directory_is_not_reported_as_missing_config(model_copy):
    model_copy.chmod(0o700 if os.geteuid() == 0 else 0o000)  # 0700: what mkdtemp makes
    msg = _as_another_user(load_model_config, model_copy)
    assert msg.startswith("PermissionError: ") and f"{model_copy} (mode 0" in msg, msg
    assert "no config.json" not in msg
    model_copy.chmod(0o755)


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_config(tmp_path / "nope")


def test_a_link_to_a_missing_file_is_named(model_copy):
    (model_copy / "model.safetensors").unlink()
    (model_copy / "model.safetensors").symlink_to(model_copy / "blobs" / "abc123")  # an HF cache snapshot, half there
    with pytest.raises(FileNotFoundError, match="model.safetensors link to files that do not exist"):
        load_model_config(model_copy)


def test_written_model_is_readable_by_others(tmp_path):
    """safetensors writes 0600 and mkdtemp 0700; a model copied into a Docker bind mount must be readable."""
    from engine.tiny import build

    out = build("tiny", tmp_path / "m", progress=False)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {f.name: 0o644 for f in out.iterdir()}


def test_the_embedded_model_directory_is_readable_by_others(tmp_path, monkeypatch):
    from engine.tiny import default_model_dir

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    assert default_model_dir().stat().st_mode & 0o777 == 0o755  # built in a mkdtemp directory, which is 0700
