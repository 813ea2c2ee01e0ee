"""Decode steps through the graph buffers (engine/cuda_graphs.py) give the plain path's tokens.

No GPU here: the buckets run eagerly on the static buffers (`capture=False`), which checks everything but the
recording itself: the bucket choice, the padding rows (stored nowhere, reading block 0), full-width block tables,
the buffers rewritten every step. tests/kernels/test_engine_triton.py runs the same through the Triton kernels.
"""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cuda_graphs import capture_sizes
from tests.engine.test_spec import _prompts


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]


def graphed(eng: LLMEngine) -> dict[tuple[int, int], int]:
    """Gives `eng` decode graphs run eagerly on their buffers; returns how often each (batch size, bucket) ran,
    filled as it runs."""
    r = eng.runner
    r.graphs = g = r.decode_graphs(capture_sizes(eng.config.max_num_seqs), capture=False)
    used: dict[tuple[int, int], int] = {}
    stage = g.stage

    def counted(reqs, fill=None):
        key = (len(reqs), g.bucket(len(reqs)))
        used[key] = used.get(key, 0) + 1
        return stage(reqs, fill)
    g.stage = counted
    return used


SETUPS = {
    "mixed": {},
    "static": {"scheduling": "static"},
    "chunked-preempting": {"max_num_batched_tokens": 32, "num_kv_blocks": 24, "block_size": 8},
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_graphed_decodes_match_the_plain_path(tiny_model_dir, setup):
    """Batches shrink through several buckets as requests of different lengths finish; two rounds, so the second
    finds the first's prompts in the prefix cache; the small pool of one setup preempts."""
    system = list(range(100, 140))
    prompts = [system + list(range(200 + 7 * i, 205 + 9 * i)) for i in range(11)] + [[5, 6, 7]]
    params = [SamplingParams(max_tokens=3 + 4 * (i % 5), temperature=0.0, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=12,
                          **{"num_kv_blocks": 64, **SETUPS[setup]})
    outs, used = [], None
    for with_graphs in (False, True):
        eng = LLMEngine(config)
        if with_graphs:
            used = graphed(eng)
        outs.append([eng.generate(prompts, params) for _ in range(2)])
        eng.check_integrity()
        if setup == "chunked-preempting":
            assert eng.stats()["num_preemptions"] > 0
    for plain_round, graph_round in zip(*outs):
        for a, b in zip(plain_round, graph_round):
            assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert len({b for _, b in used}) >= 3 and any(n < b for n, b in used), used  # several buckets, padded ones


def test_mixed_steps_and_drafts_run_eagerly(tiny_model_dir):
    """A step with a prompt chunk, or a request verifying a draft, is not a graph's: it runs the plain forward."""
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                                 speculative="ngram", speculative_adaptive=False))
    used = graphed(eng)
    prompts = _prompts()[:2]  # the first repeats a pattern: prompt lookup drafts
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, params)
    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=64))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    stats = eng.stats()
    assert stats["spec_draft_tokens"] > 0
    assert 0 < sum(used.values()) < stats["num_steps"] - 1  # the prefill and the drafting steps ran eagerly


def test_cpu_engine_ignores_no_enforce_eager(tiny_model_dir, caplog):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=16,
                                 enforce_eager=False))
    assert eng.runner.graphs is None
    assert "CUDA graphs need a CUDA device" in caplog.text


def test_capture_runs_write_no_kv(tiny_model_dir):
    """The warm-up and capture runs (all padding) store nothing: a pool kept across `rebuilt(keep_cache=True)`
    still holds its cached prompts when the new runner's graphs are recorded."""
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=32))
    prompt = list(range(50, 90))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = eng.generate([prompt], params)[0].token_ids
    new = eng.rebuilt(keep_cache=True)
    before = [t.clone() for t in new.runner.kv_caches[0]]
    graphed(new)
    g = new.runner.graphs
    for b in g.sizes:  # what `_capture` runs, warm-up and recording alike
        g._forward(b)
    assert all(torch.equal(a, b) for a, b in zip(before, new.runner.kv_caches[0]))
    again = new.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first


def test_buckets_stop_at_512():
    assert capture_sizes(4096)[-1] == 512
