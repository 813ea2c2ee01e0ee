"""Tensor parallelism's edges (engine/parallel.py; its tokens are checked against transformers in
test_correctness.py): sizes that cannot split are refused before any process starts, a dead rank ends the engine's
step with an error instead of a hang, and a rank outlives a killed engine process by about a second."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models import ModelConfig
from engine.parallel import Shard
from tests.server import REPO

pytestmark = pytest.mark.timeout(300)

MC = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 1001, "hidden_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                          "intermediate_size": 96})


def test_shards_cover_the_model_once() -> None:
    """Query heads, MLP rows and (padded) vocabulary rows split evenly; 2 KV heads split over 2 ranks and are
    replicated over 4 (ranks 0-1 share head 0, ranks 2-3 head 1)."""
    two = [Shard.plan(MC, r, 2) for r in range(2)]
    assert [(s.head_start, s.num_heads, s.kv_head_start, s.num_kv_heads, s.intermediate, s.vocab) for s in two] == \
           [(0, 4, 0, 1, 48, 501), (4, 4, 1, 1, 48, 501)]
    four = [Shard.plan(MC, r, 4) for r in range(4)]
    assert [(s.head_start, s.kv_head_start, s.num_kv_heads) for s in four] == [(0, 0, 1), (2, 0, 1), (4, 1, 1), (6, 1, 1)]
    # a rank's query heads all read its KV head: head h uses KV head h // (8 / 2)
    assert all(h // 4 == s.kv_head_start for s in four for h in range(s.head_start, s.head_start + s.num_heads))
    w = torch.arange(1001.0)[:, None]
    parts = [Shard.pad(w[s.rank * s.vocab : (s.rank + 1) * s.vocab], s.vocab) for s in two]
    assert [p.shape[0] for p in parts] == [501, 501] and torch.equal(torch.cat(parts)[:1001], w)  # padded past 1001
    assert not parts[1][-1].any()


@pytest.mark.parametrize("world,why", [(3, "8 attention heads"), (16, "attention heads"), (0, ">= 1")])
def test_sizes_that_cannot_split_are_refused(world, why) -> None:
    with pytest.raises(ValueError, match=why):
        Shard.plan(MC, 0, world)


def test_the_engine_refuses_before_starting_a_rank(tiny_model_dir) -> None:
    before = _children()
    with pytest.raises(ValueError, match="does not divide"):  # the tiny model: 4 heads
        LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="host KV tier"):
        EngineConfig(tensor_parallel_size=2, kv_offload_gb=1.0)
    assert _children() == before


def _children() -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    return {int(pid) for pid, comm in (ln.split(None, 1) for ln in out.splitlines()) if comm.strip() != "ps"}


def test_a_rank_that_dies_while_starting_fails_the_engine(tiny_model_dir, monkeypatch) -> None:
    """Rank 0 waits for every rank to join; a rank that dies first (here: it cannot import the model) ends that
    wait with an error instead of a hang."""
    monkeypatch.setattr("engine.parallel._worker_main", _die_at_start)
    with pytest.raises(RuntimeError, match="died while starting"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                               tensor_parallel_size=2))


def _die_at_start(*args) -> None:
    raise SystemExit(3)


def test_a_dead_rank_ends_the_step_with_an_error(tiny_model_dir) -> None:
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                                 tensor_parallel_size=2))
    try:
        eng.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        eng.step()
        eng.workers.procs[0].kill()
        eng.workers.procs[0].join()
        with pytest.raises(Exception):  # noqa: B017 — gloo's error; what matters is that it comes, not hangs
            for _ in range(200):
                eng.step()
    finally:
        eng.close()


def test_a_rank_outlives_a_killed_engine_by_a_second(tiny_model_dir, tmp_path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from engine import EngineConfig, LLMEngine\n"
        "if __name__ == '__main__':\n"
        f"    eng = LLMEngine(EngineConfig(model={str(tiny_model_dir)!r}, dtype='float32', num_kv_blocks=64,"
        " max_model_len=256, tensor_parallel_size=2))\n"
        "    print(eng.workers.procs[0].pid, flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        rank = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)  # no atexit, no cleanup: only the rank's own watch can end it
        proc.wait()
        deadline = time.monotonic() + 30
        while _alive(rank):
            assert time.monotonic() < deadline, "the rank outlived its engine"
            time.sleep(0.2)
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def test_an_engine_that_cannot_start_stops_its_ranks(tiny_model_dir) -> None:
    """Rank 0 fails after the group formed but before the ranks got the pool's size (a max_model_len that does not
    fit): the ranks hear "stop" in what they wait for, and exit cleanly."""
    before = _children()
    with pytest.raises(ValueError, match="needs more KV"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=4, max_model_len=512,
                               tensor_parallel_size=2))
    deadline = time.monotonic() + 20
    while {pid for pid in _children() - before if _alive(pid) and "resource_tracker" not in _args(pid)}:
        assert time.monotonic() < deadline, "a rank outlived the engine that could not start"
        time.sleep(0.2)


def _args(pid: int) -> str:
    return subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True).stdout


def test_a_vocabulary_that_does_not_split_evenly(tiny_model_dir, tmp_path) -> None:
    """Vocabulary 1,001 over two ranks: rank 1's last embedding and LM-head row is padding, never looked up and never
    sampled; the tokens equal one rank's (tied embeddings, so the LM head is the padded shard too)."""
    from engine.tiny import hf_shape_configs, write_hf_shape

    cfg = hf_shape_configs()["llama-gqa-tied"]
    cfg.vocab_size = 1001
    write_hf_shape(cfg, tmp_path, tiny_model_dir, seed=5)
    prompts = [[3 + (i * 7 + 11 * p) % 998 for i in range(10 + 13 * p)] for p in range(6)] + [[1000, 999, 1000]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        eng = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=256,
                                     tensor_parallel_size=tp))
        try:
            got[tp] = [o.token_ids for o in eng.generate(prompts, greedy)]
        finally:
            eng.close()
    assert got[2] == got[1] and all(t < 1001 for seq in got[2] for t in seq)


def test_a_quantized_cache_splits_with_its_scales(tiny_model_dir) -> None:
    """int8 KV over two ranks: each rank's pool holds its KV heads' values and scales; the tokens equal one rank's."""
    prompts = [[3 + (i * 7 + 11 * p) % 900 for i in range(12 + 17 * p)] for p in range(5)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                                     kv_cache_dtype="int8", tensor_parallel_size=tp))
        try:
            got[tp] = [o.token_ids for o in eng.generate(prompts, greedy)]
            assert len(eng.runner.kv_caches[0]) == 4 and eng.runner.kv_caches[0][0].shape[2] == 2 // tp
        finally:
            eng.close()
    assert got[2] == got[1]
