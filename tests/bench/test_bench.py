"""Smoke test of `python -m bench`: the quick runs finish and write docs/architecture.md §10 results.

Runs on the tiny test model, the workloads that take no options of their own in one subprocess (one torch import);
it checks shapes, not speed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "prefix_hit_rate")
SYSTEMS = {
    "offline": {"sluice-mixed", "sluice-prefill_first", "sluice-static", "transformers-static", "transformers-cb"},
    "stall": {"mixed@128", "mixed@256", "mixed@512", "mixed@slo", "prefill_first", "static"},
    "neighbour": {"mixed", "mixed@slo", "mixed kv25%", "mixed@slo kv40%", "mixed +prompt", "mixed@slo +prompt"},
    "prefix": {"prefix-cache-on", "prefix-cache-off"},
    "tiers": {"host-tier", "device-only"},
    "grammar": {"masks-off-step", "masks-in-step"},
}


def quick(workloads, model: Path, out: Path) -> Path:
    """`python -m bench WORKLOADS --quick` on `model` into `out`, which it returns; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *workloads, "--quick", "--no-progress", "--model", str(model), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory) -> Path:
    return quick([*SYSTEMS, "replay", "restart", "kvquant", "spec", "attention"], tiny_model_dir, tmp_path_factory.mktemp("bench"))


@pytest.mark.parametrize("workload", sorted(SYSTEMS))
def test_results_follow_design_schema(results: Path, workload: str) -> None:
    data = json.loads((results / f"{workload}.json").read_text())
    assert data["workload"] == workload and isinstance(data["model"], str)
    assert {r["system"] for r in data["rows"]} == SYSTEMS[workload]
    for row in data["rows"]:
        if row.get("error"):  # only a transformers baseline may be unavailable, and it must say why
            assert row["system"].startswith("transformers-"), row
            continue
        for key in ROW_KEYS:
            assert key in row, (row["system"], key)
            assert row[key] is None or isinstance(row[key], (int, float)), (row["system"], key, row[key])
        assert row["throughput_tok_s"] > 0 and row["output_tokens"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["itl_p50_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
        assert row["throughput_tok_s"] == max(row["rounds"]["throughput_tok_s"])  # every round kept, the best shown
    for t in data["targets"]:
        assert t["met"] in (True, False, None) and t["op"] in ("<=", ">=")
    host = data["host"]  # where it was measured, complete enough to compare two CPUs' results
    assert {"cpu", "isa", "cores", "threads", "dtype", "kernels", "torch"} <= set(host), host
    assert set(host["isa"]) <= {"AMX", "AVX512-BF16", "AVX-512", "AVX2"} and host["kernels"]
    md = (results / f"{workload}.md").read_text()
    assert md.startswith(f"# {workload}") and f"Host: {host['cpu']} (" in md and host["kernels"] in md
    assert (results / f"{workload}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_engine_counters_tell_cache_on_from_off(results: Path) -> None:
    rows = {r["system"]: r for r in json.loads((results / "prefix.json").read_text())["rows"]}
    on, off = rows["prefix-cache-on"], rows["prefix-cache-off"]
    assert off["prefix_hit_rate"] == 0.0 < on["prefix_hit_rate"]
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]


def test_the_host_tier_serves_prompts_the_pool_evicted(results: Path) -> None:
    rows = {r["system"]: r for r in json.loads((results / "tiers.json").read_text())["rows"]}
    on, off = rows["host-tier"], rows["device-only"]
    assert on["host_cache_hits"] > 0 and off["host_cache_hits"] == 0
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]


def test_stall_window_holds_the_long_prompt(results: Path) -> None:
    for row in json.loads((results / "stall.json").read_text())["rows"]:
        assert row["long_ttft_ms"] > 0 and row["window_gaps"] > 0, row


def test_paired_ratio_is_the_median_of_same_round_ratios() -> None:
    from bench.report import paired_ratio

    fast_then_slow = {"rounds": {"tok_s": [100.0, 50.0, 60.0]}}
    baseline = {"rounds": {"tok_s": [200.0, 55.0, 70.0]}}  # its best round met the other's fast one
    assert paired_ratio(fast_then_slow, baseline, "tok_s") == pytest.approx(60 / 70)  # not 100 / 200
    assert paired_ratio({"rounds": {"tok_s": [1.0, None]}}, {"rounds": {"tok_s": [4.0, 2.0]}}, "tok_s") == 0.25
    assert paired_ratio({}, baseline, "tok_s") is None


def test_replay_resumes_every_chat_whole(results: Path) -> None:
    """The quick replay run: each replay row rebuilt the engine once (the engine process's in a new process), every
    chat got every token once, and the float32 texts equal the unfaulted run's (the bench's own targets)."""
    data = json.loads((results / "replay.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {"start-over", "replay", "replay-no-prefix-cache", "replay-float32", "replay-engine-process"}
    assert all(r["whole"] for r in rows.values()) and rows["start-over"]["restarts"] == 0
    for name in ("replay", "replay-no-prefix-cache", "replay-float32", "replay-engine-process"):
        r = rows[name]
        assert r["restarts"] == 1 and 0 < r["first_resumed_ms"] <= r["resumed_p50_ms"] <= r["resumed_max_ms"], r
        assert r["prompt_tokens_recomputed"] > 0 and r["rebuild_ms"] > 0
    assert rows["replay-float32"]["identical"] == 1.0
    assert rows["replay"]["prompt_tokens_recomputed"] < rows["replay-no-prefix-cache"]["prompt_tokens_recomputed"]


def test_restart_loads_the_pinned_prompt_from_the_store(results: Path) -> None:
    data = json.loads((results / "restart.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    store, none = rows["store"], rows["no-store"]
    assert store["prompt_tokens_computed"] < none["prompt_tokens_computed"]  # the prompt came from the store
    assert store["num_cached_tokens"] == none["num_cached_tokens"] > 0
    assert data["targets"][1]["met"]  # the same first token either way


def test_kvquant_reports_accuracy_kernels_and_capacity(results: Path) -> None:
    data = json.loads((results / "kvquant.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    for kv in ("int8", "fp8"):
        r = rows[f"embedded {kv}"]
        assert 0 <= r["token_agreement"] <= 1 and r["max_logit_error"] >= 0
        attention = next(v for k, v in rows.items() if k.startswith(f"attention {'int8' if kv == 'int8' else 'float8'}"))
        assert attention["kernel_vs_twin_max_abs"] < 0.05 and attention["twin_vs_exact_cache_max_abs"] > 0
    speed = {k.split()[0]: v for k, v in rows.items() if "same KV bytes" in k}
    # the tiny model's head dim is 32: an int8 head is 32 + 4 (scale) bytes against 64 in bf16, 128 in fp32
    assert speed["int8"]["kv_blocks"] >= 1.7 * speed["auto"]["kv_blocks"]
    assert speed["int8"]["throughput_tok_s"] > 0 and speed["auto"]["output_tokens"] == speed["int8"]["output_tokens"]


def test_attention_compares_the_builds_this_cpu_has(results: Path) -> None:
    """Every case through each build (native; without AVX-512 where the CPU has it; the plain loops where it has AVX2)
    and the twin, each agreeing with the twin; the plain-loop target is n/a only without AVX2."""
    from bench.common import cpu_flags

    data = json.loads((results / "attention.json").read_text())
    flags = cpu_flags()
    systems = ["native", *(["no-avx512"] if "avx512f" in flags else []), *(["plain"] if "avx2" in flags else []), "twin"]
    assert data["config"]["systems"] == systems
    rows = data["rows"]
    assert len(rows) == len(data["config"]["dtypes"]) * len(data["config"]["head_dims"]) * len(data["config"]["batches"])
    for r in rows:
        assert all(r[f"{s}_ms"] > 0 for s in systems), r
        assert r["max_abs_vs_twin"] < (0.05 if r["dtype"] == "bfloat16" else 1e-4), r
        assert r["native_vs_twin"] == pytest.approx(r["native_ms"] / r["twin_ms"], rel=0.01, abs=1e-3)  # (rounded)
    plain = data["targets"][0]
    assert (plain["value"] is None) == ("avx2" not in flags) and data["targets"][1]["value"] > 0


def test_host_reports_each_phase_and_the_baselines(tiny_model_dir, tmp_path) -> None:
    # two rounds: the best of each row is kept (by host time; by step time where the phases overlap)
    data = json.loads((quick(["host", "--rounds", "2"], tiny_model_dir, tmp_path) / "host.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    assert set(rows) == {f"batch {b} {m}" for b in (1, 8) for m in (
        "greedy", "greedy (async outputs)", "greedy (async scheduling)", "top-p", "top-p (sorted)", "penalties",
        "penalties (looped)",
        "top-p seeded", "top-p seeded (looped)", "served (bridge)", "served (bridge, engine process)")}
    for r in rows.values():
        if "(bridge" in r["system"]:  # the real server's event loop, per step and per token it delivered
            assert r["tokens"] == 4 * r["batch"] and r["steps"] >= 4, r
            assert r["loop_ms"] > 0 and r["loop_us_per_token"] > 0 and r.get("host_ms") is None
            # tokens that share a delta (text held back mid-character) are 0 apart: the median gap may be 0
            assert r["step_ms"] > 0 and r["itl_p50_ms"] >= 0 and r["tok_s"] > 0
            continue
        if r["system"].endswith("(async scheduling)"):  # the phases overlap: only the step's time is reported
            assert r["step_ms"] > 0 and r["forward_ms"] is None
            continue
        assert r["step_ms"] >= r["forward_ms"] > 0 and r["host_ms"] > 0 and 0 < r["host_share"] < 1
        # each a median of per-step values no larger than the step's (a sum of medians may exceed the median step)
        assert all(r[k] <= r["step_ms"] for k in ("schedule_ms", "prepare_ms", "sample_ms", "forward_ms", "outputs_ms"))
        assert r["outputs_ms"] >= 0
    assert all(t["value"] is not None for t in data["targets"])  # ratios against the baselines, in the same run


def test_spec_reports_each_method_against_plain_decoding(results: Path) -> None:
    data = json.loads((results / "spec.json").read_text())
    rows = {r["system"]: r for r in data["rows"]}
    for kind in ("copy", "ask"):
        for batch in ("batch 1", "batch 64", "batch 64 (forced)"):
            for method in ("ngram", "draft"):
                r = rows[f"{kind}, {batch}, {method}"]
                assert r["identical"] and not r.get("error"), r  # greedy: the same tokens with and without
                assert r["tok_s_off"] > 0 and r["tok_s_on"] > 0 and r["speedup"] > 0
    # quoting a pasted paragraph: drafts are found and kept (how many are tried is the cost gate's call, and which
    # chats quote in 24 tokens depends on the dtype: any copy row will do)
    assert max(rows[f"copy, {b}, ngram"]["acceptance"] or 0 for b in ("batch 1", "batch 64", "batch 64 (forced)")) > 0


def test_serve_host_starts_the_engine_child_before_the_server_imports(tiny_model_dir, tmp_path) -> None:
    """The bench's server (`bench.serve_host`, the lag probe's host) starts as `sluice serve` does: its engine's child
    is spawned before the server imports torch (a refused configuration then ends it at once)."""
    script = f"""if True:
        import sys
        from service import engine_child
        started_after_torch = []
        start = engine_child.EngineChild.start

        def noting(self):
            started_after_torch.append("torch" in sys.modules)
            start(self)

        engine_child.EngineChild.start = noting
        from bench import serve_host
        try:
            code = serve_host.main([{str(tmp_path / "lag")!r}, "--model", {str(tiny_model_dir)!r},
                             "--tensor-parallel-size", "2", "--kv-offload-gb", "1"])  # argparse takes them, not the engine
        finally:
            print(started_after_torch)
        sys.exit(code)
    """
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.strip() == "[False]", proc.stdout + proc.stderr[-2000:]
