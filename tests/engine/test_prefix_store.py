"""The prefix store (engine/prefix_store.py): a restarted engine loads its pinned prefixes' KV from disk instead of
computing it, and serves exactly what computing it would; a store made for another model, dtype or prompt, or a
corrupt one, is refused and rebuilt, never used."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.prefix_store import PrefixStore

SYSTEM = [3 + (i * 13) % 900 for i in range(100)]  # 6 full blocks of 16, and 4 tokens more
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def make(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))

    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(**{"model": str(tiny_model_dir), "dtype": "float32", "num_kv_blocks": 64,
                                         "max_model_len": 256, **kw}))
    return make


def _store(eng: LLMEngine) -> PrefixStore:
    return eng._prefix_store()


def _shape(eng: LLMEngine, tokens: list[int]) -> list:
    return eng.runner.block_shapes(len(tokens) // 16)


def _answer(eng: LLMEngine):
    return eng.generate([SYSTEM + [7, 8, 9]], GREEDY)[0]


def test_a_restarted_engine_loads_its_pinned_prefix(make, caplog) -> None:
    first = make()
    assert first.pin_prefix(SYSTEM) == 96 and _store(first).path(SYSTEM).is_file()
    expected = _answer(first)
    caplog.set_level(logging.INFO, logger="sluice.engine")
    second = make()
    assert second.pin_prefix(SYSTEM) == 96
    assert second.stats()["prompt_tokens_computed"] == 0 and "from the prefix store" in caplog.text
    got = _answer(second)
    assert got.token_ids == expected.token_ids and got.num_cached_tokens == 96
    second.check_integrity()
    k, v = second.runner.read_blocks([b.id for b in second.block_manager.pinned])
    k0, v0 = first.runner.read_blocks([b.id for b in first.block_manager.pinned])
    assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_quantized_cache_round_trips_with_its_scales(make, kv_cache_dtype) -> None:
    first = make(kv_cache_dtype=kv_cache_dtype)
    assert first.pin_prefix(SYSTEM) == 96
    expected = _answer(first)
    second = make(kv_cache_dtype=kv_cache_dtype)
    assert second.pin_prefix(SYSTEM) == 96 and second.stats()["prompt_tokens_computed"] == 0
    assert _answer(second).token_ids == expected.token_ids
    got = second.runner.read_blocks([b.id for b in second.block_manager.pinned])
    want = first.runner.read_blocks([b.id for b in first.block_manager.pinned])
    assert len(got) == 4 and got[0].dtype == first.layout.cache_dtype and got[2].dtype == torch.float32
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
    assert make()._prefix_store().dir != _store(first).dir  # a float32 cache is another store


def test_a_corrupt_store_is_refused_and_rebuilt(make, caplog) -> None:
    first = make()
    first.pin_prefix(SYSTEM)
    expected = _answer(first)
    path = _store(first).path(SYSTEM)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a bit of the tensors' bytes
    path.write_bytes(bytes(data))
    second = make()
    second.pin_prefix(SYSTEM)
    assert "corrupt" in caplog.text and second.stats()["prompt_tokens_computed"] > 0  # computed, not loaded
    assert _answer(second).token_ids == expected.token_ids
    third = make()  # the store was written again, whole
    third.pin_prefix(SYSTEM)
    assert third.stats()["prompt_tokens_computed"] == 0


def test_a_store_made_for_another_model_or_prompt_is_never_used(make, tiny_model_dir, tmp_path, caplog) -> None:
    first = make()
    first.pin_prefix(SYSTEM)
    store = _store(first)
    other = tmp_path / "other-model"
    other.mkdir()
    config = (tiny_model_dir / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps_"')
    (other / "config.json").write_text(config)
    shape = _shape(first, SYSTEM)
    foreign = PrefixStore(store.dir.parents[1], other, first.dtype, first.dtype, 16)
    assert foreign.model != store.model and foreign.load(SYSTEM, shape) is None  # another model: another key
    foreign.dir.mkdir(parents=True)
    shutil.copy(store.path(SYSTEM), foreign.path(SYSTEM))  # the file, put where that model looks
    assert foreign.load(SYSTEM, shape) is None and "another model" in caplog.text
    shorter = SYSTEM[:-20]
    shutil.copy(store.path(SYSTEM), store.path(shorter))  # another prompt's name on it
    assert store.load(shorter, _shape(first, shorter)) is None
    for dtype, kv_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.int8)):  # another dtype
        assert PrefixStore(store.dir.parents[1], tiny_model_dir, dtype, kv_dtype, 16).load(SYSTEM, shape) is None
    (s, d), rest = shape[0], shape[1:]
    assert store.load(SYSTEM, [((s[0] + 1, *s[1:]), d), *rest]) is None and "are not" in caplog.text  # a shape
    assert store.load(SYSTEM, [(s, torch.float16), *rest]) is None  # a dtype
    store.path(SYSTEM).write_bytes(b"\xff" * 64)  # not even a header
    assert store.load(SYSTEM, shape) is None and "unreadable" in caplog.text


def test_no_store_when_turned_off(make) -> None:
    eng = make(prefix_store=False)
    eng.pin_prefix(SYSTEM)
    assert eng._prefix_store() is None
    assert not any(make()._prefix_store().dir.parent.parent.parent.glob("**/*.safetensors"))


def test_prompts_sharing_blocks_and_bfloat16(make) -> None:
    """A second pinned prompt that shares the first one's leading blocks pins them as they are (on the device
    already) and loads only its own; bfloat16 KV round-trips exactly."""
    other = SYSTEM[:64] + [5 + (i * 7) % 900 for i in range(40)]  # 4 blocks shared, 2 of its own
    first = make(dtype="bfloat16")
    first.pin_prefix(SYSTEM)
    first.pin_prefix(other)
    expected = [first.generate([p + [7, 8]], GREEDY)[0].token_ids for p in (SYSTEM, other)]
    second = make(dtype="bfloat16")
    second.pin_prefix(SYSTEM)
    assert second.pin_prefix(other) == 96 and second.stats()["prompt_tokens_computed"] == 0
    assert [second.generate([p + [7, 8]], GREEDY)[0].token_ids for p in (SYSTEM, other)] == expected
    assert len({b.id for b in second.block_manager.pinned}) == 8  # 6 + 2: the shared four pinned twice
    second.check_integrity()


def test_a_store_that_cannot_be_written_costs_nothing_but_the_store(make, monkeypatch, caplog) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError("I/O error: no space left on device")  # as safetensors reports it: not an OSError

    monkeypatch.setattr(PrefixStore, "save", refuse)
    eng = make()
    assert eng.pin_prefix(SYSTEM) == 96 and "cannot write the prefix store" in caplog.text
    assert _answer(eng).num_cached_tokens == 96
