"""Decode and mixed steps through the graph buffers (engine/cuda_graphs.py) give the plain path's tokens.

No GPU here: the buckets run eagerly on the static buffers (`capture=False`), which checks everything but the
recording itself: the bucket choice, the padding (one sequence of every padding token, stored nowhere, reading block
0; empty ones after the step's), full-width block tables, the buffers rewritten every step.
tests/kernels/test_engine_triton.py runs the same through the Triton kernels.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cuda_graphs import StepGraphs, buckets, capture_sizes, graph_sizes, token_sizes
from tests.engine.test_spec import _prompts


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]


def test_token_sizes():
    assert token_sizes(1) == [16]
    assert token_sizes(40) == [16, 32, 48]
    assert token_sizes(2048) == [*range(16, 256, 16), *range(256, 512, 32), *range(512, 1024, 64),
                                 *range(1024, 2049, 128)]
    sizes = token_sizes(10**6)
    assert sizes[-1] == 8192 and all((b - a) * 8 <= max(a, 128) for a, b in zip(sizes, sizes[1:]))


def test_bucket_choice():
    g = StepGraphs.__new__(StepGraphs)
    g.decode, g.mixed = buckets(capture_sizes(20), token_sizes(100), 20, 64)
    g.max_num_seqs = 20
    assert g.mixed[0] == (16, 22)  # 112 tokens of padding at most: two sequences of 56
    assert buckets([], token_sizes(100), 14, 64)[1][0] == (16, 17)  # not (16, 16): a mixed step is not tiled as decodes
    assert g.bucket(1, 1) == (1, 1) and g.bucket(3, 3) == (4, 4) and g.bucket(17, 17) == (32, 32)
    assert g.bucket(4, 3) == (16, 22) and g.bucket(33, 2) == (48, 22) and g.bucket(112, 20) == (112, 22)
    assert g.bucket(113, 20) is None
    # the fewest prompt tokens beside d decodes that leave every bucket (the step-cost model prices those as eager)
    assert g.eager_from(3) == 110 and g.eager_from(0) == 113 and g.eager_from(20) == 93
    assert g.eager_from(33) == 0  # more sequences than any bucket holds: eager with no prompt token
    assert g.eager_from(3, drafts=4) == 106  # drafts take a mixed bucket's tokens, and need its logits rows
    assert g.eager_from(20, drafts=2) == 91 and g.eager_from(20, drafts=3) == 0  # 23 rows: more than 22
    g.decode = g.decode[:3]  # decode steps past the largest decode bucket take a mixed one
    assert g.bucket(5, 5) == (16, 22) and g.eager_from(5) == 108
    g.mixed = []
    assert g.bucket(5, 5) is None and g.bucket(4, 3) is None
    # decode steps only: a prompt token runs eagerly, unless it is a one-token chunk (as many tokens as sequences)
    assert g.eager_from(5) == 0 and g.eager_from(2) == 2 and g.eager_from(4) == 1 and g.eager_from(2, drafts=1) == 0


@pytest.mark.parametrize("max_len", [16, 64, 4096])
def test_padding_fits_every_bucket(max_len):
    """For steps of every size a bucket takes: the padded inputs describe t tokens over s sequences, the step's
    untouched, every padding token stored nowhere and every padding sequence's context within `max_len` (its block
    table row) and within the blocks `pad` says to point at block 0."""
    from engine.cuda_graphs import pad
    from engine.step_inputs import StepInputs

    bs, max_seqs = 4, 12
    decode, mixed = buckets(capture_sizes(max_seqs), token_sizes(200), max_seqs, max_len)
    g = StepGraphs.__new__(StepGraphs)
    g.decode, g.mixed, g.max_num_seqs = decode, mixed, max_seqs
    rng = np.random.default_rng(0)
    for _ in range(300):
        B = int(rng.integers(1, max_seqs + 1))
        ns = np.ones(B, dtype=np.int64) if rng.random() < 0.3 else rng.integers(0, 30, B) + 1
        cu = np.concatenate([[0], np.cumsum(ns)])
        key = g.bucket(int(cu[-1]), B)
        if key is None:
            continue
        t, s = key
        inp = StepInputs(256, 32, max_len // bs, pin=False)
        inp.cu_seqlens_q[: B + 1] = torch.from_numpy(cu)
        blocks = pad(inp, cu, key, bs)
        cuq, lens = inp.cu_seqlens_q[: s + 1].tolist(), inp.seq_lens[:s].tolist()
        assert cuq[: B + 1] == cu.tolist() and cuq[-1] == t and all(a <= b for a, b in zip(cuq, cuq[1:]))
        assert (inp.slot_mapping[int(cu[-1]) : t] == -1).all() and (inp.positions[int(cu[-1]) : t] == 0).all()
        for j in range(B, s):
            n = cuq[j + 1] - cuq[j]
            assert lens[j] == n <= max_len and -(-n // bs) <= blocks <= max_len // bs
        if cu[-1] == B:  # a decode step: one token per padding sequence
            assert lens[B:] == [1] * (s - B)


def uncaptured(eng: LLMEngine, mixed: bool = True) -> dict[tuple[int, int, tuple[int, int]], int]:
    """Gives `eng` graphs run eagerly on their buffers: decode buckets, and mixed ones unless `mixed=False`; returns
    how often each (tokens, sequences, bucket) ran, filled as it runs (and `graphs.logits_rows`)."""
    r, cfg = eng.runner, eng.config
    decode, tokens = graph_sizes(cfg)
    r.graphs = g = r.step_graphs(decode, tokens if mixed else [], capture=False)
    used: dict[tuple[int, int, tuple[int, int]], int] = {}
    g.logits_rows = []  # (sequences, logits rows) of each replay
    stage = g.stage

    def counted(inputs, cu, rows, fill=None):
        T, B = int(cu[-1]), len(cu) - 1
        key = (T, B, g.bucket(T, B))
        used[key] = used.get(key, 0) + 1
        g.logits_rows.append((B, len(rows)))
        run, tables = stage(inputs, cu, rows, fill), inputs.block_tables.clone()

        def checked():  # what the replay reads: the step's tables, and block 0 for the padding sequences' context
            out = run()
            s, bs = key[2][1], g.block_size
            assert torch.equal(g.block_tables[:B, : tables.shape[1]], tables)
            for j in range(B, s):
                assert (g.block_tables[j, : -(-int(g.seq_lens[j]) // bs)] == 0).all()
            return out
        return checked
    g.stage = counted
    return used


SETUPS = {
    "mixed": {},
    "static": {"scheduling": "static"},
    "chunked-preempting": {"max_num_batched_tokens": 32, "num_kv_blocks": 24, "block_size": 8},
}


@pytest.mark.parametrize("mixed", [False, True], ids=["decode-only", "full"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_graphed_steps_match_the_plain_path(tiny_model_dir, setup, mixed):
    """Batches shrink through several buckets as requests of different lengths finish; two rounds, so the second
    finds the first's prompts in the prefix cache; the small pool of one setup preempts. With mixed graphs the
    prompt steps replay too: chunks beside decodes, chunks that sample nothing, padding past a block."""
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
            used = uncaptured(eng, mixed)
        outs.append([eng.generate(prompts, params) for _ in range(2)])
        eng.check_integrity()
        if setup == "chunked-preempting":
            assert eng.stats()["num_preemptions"] > 0
    for plain_round, graph_round in zip(*outs):
        for a, b in zip(plain_round, graph_round):
            assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    decode = {k: n for k, n in used.items() if k[2][0] == k[2][1]}
    assert len({b for _, _, b in decode}) >= 3 and any(B < b[1] for _, B, b in decode), used  # padded buckets
    steps = [k for k in used if k[2][0] != k[2][1]]
    if mixed:  # prompt steps replayed, some padded past a block, some beside decodes
        assert any(T > B > 1 for T, B, _ in steps), used
        if setup != "chunked-preempting":  # (whose prompt steps fill their budget: 32 tokens, a bucket)
            assert any(t > T for T, _, (t, _) in steps), used
    else:
        assert not steps, used


def test_padding_past_a_block_and_chunks_that_sample_nothing(tiny_model_dir):
    """Blocks of 4 tokens and a budget of 48: the padding sequence spans several blocks (all block 0), prompts are
    cut into chunks that sample nothing, beside decodes; logprobs of every row as the plain path's."""
    # steps of 48, 48, then 3 decodes + 16 (prompts that share no block: one that did would wait for the other's)
    prompts = [list(range(s, s + n)) for s, n in ((30, 40), (200, 18), (400, 3), (600, 50))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in (5, 9, 12, 3)]
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=96,
                          max_num_batched_tokens=48, max_num_seqs=4)
    plain = LLMEngine(config).generate(prompts, params)
    eng = LLMEngine(config)
    used = uncaptured(eng)
    outs = eng.generate(prompts, params)
    for a, b in zip(plain, outs):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert any(t - T > 4 for T, _, (t, _) in used), used  # padding over two blocks and more
    assert any(T > B > 1 and T < t for T, B, (t, _) in used), used


@pytest.mark.parametrize("setup", ["ngram", "draft model", "rows past the bucket"])
def test_steps_verifying_drafts_replay(tiny_model_dir, setup, monkeypatch):
    """A step with requests verifying drafts replays as a mixed step, the verified positions among its LM-head rows;
    a draft model's own forwards stay eager. With 2 sequences (buckets of a few more, for padding) two requests
    verifying 4 drafts each want 10 rows: those steps run eagerly, and the step-cost model is told so. The tokens
    are the plain path's."""
    import engine.engine as engine_module

    labels = []
    features = engine_module._cost_features
    monkeypatch.setattr(engine_module, "_cost_features", lambda *a: labels.append(features(*a)[3]) or features(*a))
    kw = {"max_num_seqs": 2} if setup == "rows past the bucket" else {}
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                                 speculative="ngram" if setup != "draft model" else f"draft:{tiny_model_dir}",
                                 speculative_adaptive=False, **kw))
    used = uncaptured(eng)
    rows = eng.runner.graphs.logits_rows
    prompts = _prompts()[:2]  # the first repeats a pattern: prompt lookup drafts
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = eng.generate(prompts, params)
    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=64))
    want = plain.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    for a, b in zip(outs, want):
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    stats = eng.stats()
    assert stats["spec_draft_tokens"] > 0
    assert len(labels) == stats["num_steps"] and sum(labels) == stats["num_steps"] - sum(used.values())
    if setup == "rows past the bucket":
        seqs = eng.runner.graphs.mixed[0][1]
        assert 0 < sum(used.values()) < stats["num_steps"] and all(r <= seqs < 10 for _, r in rows)
    else:
        assert sum(used.values()) == stats["num_steps"] and any(r > b for b, r in rows)  # drafting steps replayed


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
    uncaptured(new)
    g = new.runner.graphs
    for key in g.decode + g.mixed:  # what `_capture` runs, warm-up and recording alike
        g._pad_all(key)
        g._forward(key)
    assert all(torch.equal(a, b) for a, b in zip(before, new.runner.kv_caches[0]))
    again = new.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first


def test_buckets_stop_at_512():
    assert capture_sizes(4096)[-1] == 512


@pytest.mark.parametrize("mode, mixed", [("full", True), ("full_decode_only", False)])
def test_cudagraph_mode_picks_the_buckets(monkeypatch, mode, mixed):
    """What an engine on one GPU would capture: decode buckets always, mixed ones up to the step budget under
    "full" (the default) only."""
    import types

    import sluice_kernels as kernels

    monkeypatch.setattr(kernels, "attention_backend", lambda *a: "triton")
    eng = types.SimpleNamespace(config=EngineConfig(enforce_eager=False, cudagraph_mode=mode, max_num_seqs=64,
                                                    max_num_batched_tokens=1000),
                                device=torch.device("cuda"), workers=None, dtype=torch.bfloat16,
                                layout=types.SimpleNamespace(cache_dtype=torch.bfloat16))
    decode, tokens = LLMEngine._graph_sizes(eng)
    assert decode == capture_sizes(64) and tokens == (token_sizes(1000) if mixed else [])
    assert tokens == [] or tokens[-1] == 1024
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineConfig(cudagraph_mode="piecewise")
