"""The engine driven by the Triton kernels (interpreted on CPU) emits the same greedy tokens as the
torch path, through chunked prefill, steps mixing chunks with decodes, and decodes. Each side runs in
its own process because `kernels` reads `SLUICE_KERNELS` once, at import."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import sluice_kernels as kernels
from engine import EngineConfig, LLMEngine, SamplingParams
assert kernels.MODE == sys.argv[2], kernels.MODE
# A small budget and chunk cap force chunks over cached context and steps mixing them with decodes.
eng = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", device="cpu", block_size=8, num_kv_blocks=32,
                             max_num_batched_tokens=16, long_prefill_token_threshold=8))
prompts = [list(range(40, 62)), [5, 9, 300, 7], list(range(500, 510))]
outs = eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Two layers, GQA 4, head_dim 16: the interpreter's cost is per program, so keep it small."""
    from engine.tiny import write_model

    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 16, "intermediate_size": 96}
    return write_model(tmp_path_factory.mktemp("triton-engine"), cfg, seed=3, progress=False)


def _start(model: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, SLUICE_KERNELS=mode, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(model), mode], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _tokens(proc: subprocess.Popen) -> list[list[int]]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


GRAPHS_SCRIPT = """
import json, sys
import sluice_kernels as kernels
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cuda_graphs import capture_sizes, token_sizes
assert kernels.MODE == "triton", kernels.MODE
prompts = [list(range(40, 40 + n)) for n in (22, 5, 13)]
toks = []
for graphs in (False, True):
    # max_model_len 1024: full-width block tables make the decode buckets split the KV (2 splits of 512); a budget of
    # 24 tokens: prompt chunks beside decodes in mixed buckets
    eng = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", device="cpu", block_size=16, num_kv_blocks=64,
                                 max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=24))
    if graphs:
        r = eng.runner
        r.graphs = r.step_graphs(capture_sizes(4), token_sizes(24), capture=False)
        runs = []
        stage = r.graphs.stage
        r.graphs.stage = lambda inputs, cu, rows, fill=None: runs.append((int(cu[-1]), len(cu) - 1)) or stage(
            inputs, cu, rows, fill)
    toks.append([o.token_ids for o in eng.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0,
                                                                            ignore_eos=True) for m in (4, 2, 3)])])
print(json.dumps({"eager": toks[0], "graphs": toks[1], "runs": runs}))
"""


def test_step_graph_buffers_through_triton_kernels(model_dir):
    """The graph path's buffers (engine/cuda_graphs.py, run eagerly here) through the Triton kernels: a padded
    decode bucket (3 requests in 4), full-width block tables with split KV, mixed buckets (prompt chunks beside
    decodes, padding sequences, empty ones), the same tokens as the plain path."""
    env = dict(os.environ, SLUICE_KERNELS="triton", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", GRAPHS_SCRIPT, str(model_dir)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [len(t) for t in got["eager"]] == [4, 2, 3]
    assert got["graphs"] == got["eager"]
    runs = [tuple(r) for r in got["runs"]]
    assert (3, 3) in runs, runs  # a padded decode step
    assert any(T > B > 1 for T, B in runs), runs  # prompt chunks beside decodes


def test_triton_engine_matches_torch_engine(model_dir):
    procs = {mode: _start(model_dir, mode) for mode in ("torch", "triton")}  # both at once
    torch_tokens, triton_tokens = _tokens(procs["torch"]), _tokens(procs["triton"])
    assert [len(t) for t in torch_tokens] == [3, 3, 3]
    assert triton_tokens == torch_tokens
