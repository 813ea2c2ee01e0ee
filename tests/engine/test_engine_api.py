"""LLMEngine's public surface (docs/architecture.md §3, §6): validation and max_tokens at add_request, abort at any
stage, a model failure that fails only its step, stats keys, generate over text and token prompts, and step outputs
only for requests that advanced."""
from __future__ import annotations

import shutil

import pytest

from engine import EngineConfig, LLMEngine, PromptTooLongError, SamplingParams, StepError

MAX_LEN = 256
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
STATS_KEYS = {"num_running", "num_waiting", "num_kv_blocks", "num_free_kv_blocks", "kv_usage", "prefix_cache_queries",
              "prefix_cache_hits", "num_preemptions", "num_steps", "prompt_tokens_computed", "generation_tokens",
              "scheduler_degraded", "scheduler_mode_changes", "num_host_kv_blocks", "num_free_host_kv_blocks",
              "host_cache_hits", "host_blocks_offloaded", "host_blocks_loaded", "host_cache_evictions",
              "host_copy_seconds", "kv_cache_bytes", "host_kv_cache_bytes"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    # a small budget, so a 200-token prompt takes several steps to prefill
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=MAX_LEN,
                                  max_num_batched_tokens=32, max_num_seqs=4))


@pytest.fixture
def eng(engine):
    """The shared engine; every test must leave it idle, consistent and with its whole pool free."""
    yield engine
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.stats()["num_free_kv_blocks"] == engine.stats()["num_kv_blocks"]


_n = iter(range(10**9))


def prompt(n: int) -> list[int]:
    """A fresh prompt of n token ids, unlike any other (so the prefix cache never interferes)."""
    base = next(_n)
    return [3 + (base * 7919 + i * 31) % 1000 for i in range(n)]


def drain(eng: LLMEngine, max_steps: int = 500) -> list:
    outs = []
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return outs
        outs += eng.step()
    raise AssertionError("engine did not drain")


# -- validation at add_request ------------------------------------------------------------------


def test_prompt_longer_than_max_model_len_is_rejected(eng):
    with pytest.raises(ValueError, match=rf"{MAX_LEN + 1}.*{MAX_LEN}"):
        eng.add_request("long", prompt(MAX_LEN + 1), GREEDY)
    text = "😀 世界 " * 100
    n = len(eng.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert n > MAX_LEN
    with pytest.raises(ValueError, match=rf"{n}.*{MAX_LEN}"):
        eng.add_request("long", text, GREEDY)  # text: counted in tokens
    assert not eng.has_unfinished()
    eng.add_request("long", prompt(4), GREEDY)  # the id was not taken by the failed attempts
    drain(eng)


def test_prompt_with_no_room_to_generate_is_rejected(eng):
    with pytest.raises(ValueError, match=rf"{MAX_LEN}.*room"):
        eng.add_request("full", prompt(MAX_LEN), GREEDY)
    assert not eng.has_unfinished()


def test_prompt_near_the_limit_is_cut_by_length(eng):
    out = eng.generate([prompt(MAX_LEN - 3)], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_max_tokens_none_takes_all_the_room_the_prompt_leaves(eng):
    out = eng.generate([prompt(MAX_LEN - 5)], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    eng.add_request("none", prompt(MAX_LEN - 5), SamplingParams(max_tokens=None), fit_max_tokens=False)
    assert eng.requests["none"].max_tokens == 5  # resolved once, at admission
    eng.abort("none")
    drain(eng)


def test_max_tokens_beyond_the_room_is_refused_unless_fitted(eng):
    p = prompt(MAX_LEN - 10)
    with pytest.raises(PromptTooLongError) as info:
        eng.add_request("big", p, SamplingParams(max_tokens=11), fit_max_tokens=False)
    assert str(info.value) == (f"the context is {MAX_LEN} tokens; the prompt has {MAX_LEN - 10} and max_tokens asks "
                               "for 11 more (at most 10 fit)")
    assert not eng.has_unfinished() and "big" not in eng.requests
    eng.add_request("big", p, SamplingParams(max_tokens=10), fit_max_tokens=False)  # exactly the room: accepted
    eng.add_request("capped", p, SamplingParams(max_tokens=11))  # fit_max_tokens=True (the default): capped
    assert eng.requests["big"].max_tokens == eng.requests["capped"].max_tokens == 10
    eng.abort("big")
    eng.abort("capped")
    drain(eng)


@pytest.mark.parametrize("bad", [[], [0, 1024], [-1, 5]])
def test_empty_or_out_of_vocab_prompt_is_rejected(eng, bad):
    with pytest.raises(ValueError):
        eng.add_request("bad", bad, GREEDY)


def test_duplicate_request_id_is_rejected(eng):
    eng.add_request("dup", prompt(5), GREEDY)
    with pytest.raises(ValueError, match="dup"):
        eng.add_request("dup", prompt(5), GREEDY)
    outs = drain(eng)
    assert [o.request_id for o in outs if o.finished] == ["dup"]  # the first one is undisturbed
    assert sum(len(o.new_token_ids) for o in outs) == 8
    eng.add_request("dup", prompt(5), GREEDY)  # a finished id may be used again
    drain(eng)


# -- abort ----------------------------------------------------------------------------------------


def _abort_checked(eng: LLMEngine, rid: str) -> None:
    eng.abort(rid)
    outs = eng.step()
    mine = [o for o in outs if o.request_id == rid]
    assert len(mine) == 1
    assert mine[0].finished and mine[0].finish_reason == "abort" and mine[0].new_token_ids == []
    s = eng.stats()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["kv_usage"] == 0.0
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert not eng.has_unfinished() and eng.step() == []  # reported once, then gone
    eng.abort(rid)  # a second abort is harmless too
    assert eng.step() == []


def test_abort_mid_prefill_frees_the_blocks(eng):
    eng.add_request("pre", prompt(200), GREEDY)  # 200 tokens, 32 a step
    started = eng.step()  # the first chunk announces the request (empty delta), so callers know it started
    assert [(o.request_id, o.new_token_ids, o.text_delta, o.finished) for o in started] == [("pre", [], "", False)]
    for _ in range(2):
        assert eng.step() == []  # later chunks: no token yet, nothing to report
    req = eng.requests["pre"]
    assert 0 < req.num_computed_tokens < req.num_prompt_tokens
    assert eng.stats()["num_free_kv_blocks"] < eng.stats()["num_kv_blocks"]
    _abort_checked(eng, "pre")


def test_abort_mid_decode_frees_the_blocks(eng):
    eng.add_request("dec", prompt(20), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    got = []
    while len(got) < 3:
        got += [t for o in eng.step() for t in o.new_token_ids]
    assert eng.stats()["num_free_kv_blocks"] < eng.stats()["num_kv_blocks"]
    _abort_checked(eng, "dec")


def test_abort_while_waiting(eng):
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i in range(5):  # max_num_seqs=4: the last one waits
        eng.add_request(f"w{i}", prompt(10), p)
    eng.step()
    assert eng.stats()["num_waiting"] == 1 and eng.requests["w4"].num_computed_tokens == 0
    eng.abort("w4")
    outs = drain(eng)
    by_id = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in by_id["w4"]] == ["abort"]
    assert all(by_id[f"w{i}"][-1].finish_reason == "length" for i in range(4))


def test_abort_leaves_other_requests_alone(eng):
    p1, p2 = prompt(20), prompt(30)
    alone = eng.generate([p1], GREEDY)[0].token_ids
    eng.add_request("keep", p1, GREEDY)
    eng.add_request("drop", p2, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    outs = []
    for _ in range(3):
        outs += eng.step()
    eng.abort("drop")
    outs += drain(eng)
    assert [t for o in outs if o.request_id == "keep" for t in o.new_token_ids] == alone
    keep = [o for o in outs if o.request_id == "keep"]
    assert keep[-1].finished and keep[-1].finish_reason == "length"


def test_abort_unknown_id_is_harmless(eng):
    eng.abort("never-added")
    assert eng.step() == [] and not eng.has_unfinished()
    eng.add_request("x", prompt(5), GREEDY)
    eng.abort("y")
    outs = drain(eng)
    assert {o.request_id for o in outs} == {"x"} and outs[-1].finish_reason == "length"
    eng.abort("x")  # already finished
    assert eng.step() == []


# -- a failing model ----------------------------------------------------------------------------


def test_a_transient_model_failure_is_retried_and_the_retry_stands(eng, monkeypatch):
    """Faults come through a seam (the runner, here), never through a flag the engine checks every step."""
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = [prompt(10) for _ in range(3)]
    clean = [c.token_ids for c in eng.generate(prompts, p)]
    real_run, calls = eng.runner.run, []

    def fail_once(batch, samples):
        calls.append([r.request_id for r in batch.reqs])
        if len(calls) == 1:
            raise RuntimeError("the model failed, once")
        return real_run(batch, samples)

    monkeypatch.setattr(eng.runner, "run", fail_once)
    again = eng.generate(prompts, p)
    assert [c.token_ids for c in again] == clean and all(c.finish_reason == "length" for c in again)
    assert calls[0] == calls[1]  # the same step, run again


def test_a_failure_outside_the_model_loses_no_pending_abort(eng, monkeypatch):
    """Aborts taken before a step that fails anywhere (here: the scheduler) are reported by the next step."""
    p = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    eng.add_request("kept", prompt(10), p)
    eng.add_request("gone", prompt(10), p)
    eng.step()
    eng.abort("gone")
    real = eng.scheduler.schedule

    def broken(**kw):
        raise RuntimeError("scheduler broken")

    monkeypatch.setattr(eng.scheduler, "schedule", broken)
    with pytest.raises(RuntimeError):
        eng.step()
    monkeypatch.setattr(eng.scheduler, "schedule", real)
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("gone", "abort")]
    eng.abort("kept")
    drain(eng)


@pytest.fixture(scope="module")
def isolated(tiny_model_dir):
    """Fresh engines for fault isolation: no prefix cache, so a clean run and a faulty one compute the same."""
    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128,
                                      max_model_len=MAX_LEN, max_num_batched_tokens=32, max_num_seqs=8,
                                      enable_prefix_caching=False))
    return make


def _bystanders() -> list[tuple[str, list[int], SamplingParams]]:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [(f"g{i}", prompt(9 + 5 * i), greedy) for i in range(4)] + [
        (f"s{i}", prompt(20), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True))
        for i in range(2)]


def _run_to_end(eng: LLMEngine) -> tuple[dict[str, list[int]], list[StepError]]:
    tokens: dict[str, list[int]] = {}
    errors: list[StepError] = []
    for _ in range(500):
        if not eng.has_unfinished():
            return tokens, errors
        try:
            outs = eng.step()
        except StepError as e:
            errors.append(e)
            continue
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("engine did not drain")


def test_a_failing_request_is_isolated_and_bystanders_match_a_clean_run(isolated):
    """One request whose computation fails (from its third token on) is found by halving the failed step and
    aborted alone; the others, greedy and seeded, produce exactly what they produce without it."""
    bystanders = _bystanders()
    clean_eng = isolated()
    for rid, ids, p in bystanders:
        clean_eng.add_request(rid, ids, p)
    clean, errors = _run_to_end(clean_eng)
    assert not errors and all(len(t) == 12 for t in clean.values())

    eng = isolated()
    real_run, probes = eng.runner.run, []

    def run_or_fail(batch, samples):
        bad = next((r for r in batch.reqs if r.request_id == "bad"), None)
        probes.append(len(batch))
        if bad is not None and bad.num_output_tokens >= 2:
            raise RuntimeError("this request's computation fails")
        return real_run(batch, samples)

    eng.runner.run = run_or_fail
    requests = list(bystanders)
    requests.insert(3, ("bad", prompt(15), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    for rid, ids, p in requests:
        eng.add_request(rid, ids, p)
    tokens, errors = _run_to_end(eng)
    assert [e.request_ids for e in errors] == [["bad"]]
    assert len(tokens["bad"]) == 2
    assert {rid: t for rid, t in tokens.items() if rid != "bad"} == clean  # identical, seeded ones included
    assert eng.stats()["num_free_kv_blocks"] == eng.stats()["num_kv_blocks"]
    eng.check_integrity()


def test_requests_that_fail_only_together_are_all_aborted(isolated):
    """No request fails alone: every request of the failed step is dropped (each failure drops someone)."""
    eng = isolated()
    real_run = eng.runner.run

    def fails_with_two(batch, samples):
        if {"a", "b"} <= {r.request_id for r in batch.reqs}:
            raise RuntimeError("a and b break each other")
        return real_run(batch, samples)

    eng.runner.run = fails_with_two
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b"):
        eng.add_request(rid, prompt(8), p)
    tokens, errors = _run_to_end(eng)
    assert [sorted(e.request_ids) for e in errors] == [["a", "b"]] and not tokens
    eng.check_integrity()
    assert eng.stats()["num_free_kv_blocks"] == eng.stats()["num_kv_blocks"]


# -- stats ----------------------------------------------------------------------------------------


def test_stats_keys_and_counters(eng):
    s0 = eng.stats()
    assert STATS_KEYS <= set(s0)
    assert all(isinstance(v, (int, float)) for v in s0.values())
    assert s0["num_kv_blocks"] == 64 and 0.0 <= s0["kv_usage"] <= 1.0

    p = prompt(40)
    first = eng.generate([p], GREEDY)[0]
    s1 = eng.stats()
    assert first.num_prompt_tokens == 40 and first.num_cached_tokens == 0
    assert s1["prompt_tokens_computed"] - s0["prompt_tokens_computed"] == 40
    assert s1["generation_tokens"] - s0["generation_tokens"] == 8
    assert s1["prefix_cache_queries"] - s0["prefix_cache_queries"] == 40
    assert s1["prefix_cache_hits"] == s0["prefix_cache_hits"]
    assert s1["num_steps"] - s0["num_steps"] == 2 + 7  # 40 prompt tokens at 32 a step, then 7 decodes

    again = eng.generate([p], GREEDY)[0]
    s2 = eng.stats()
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == 32  # two full 16-token blocks; the last token is always recomputed
    assert s2["prefix_cache_hits"] - s1["prefix_cache_hits"] == 32
    assert s2["prompt_tokens_computed"] - s1["prompt_tokens_computed"] == 8

    eng.add_request("busy", prompt(10), GREEDY)
    eng.step()
    s3 = eng.stats()
    assert s3["num_running"] == 1 and s3["num_waiting"] == 0 and s3["kv_usage"] > 0
    drain(eng)


# -- generate ---------------------------------------------------------------------------------------


def test_generate_text_and_token_prompts_agree(eng):
    texts = ["Hello world, the model", "café 日本語 😀", "a"]
    ids = [eng.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    by_text = eng.generate(texts, GREEDY)
    by_ids = eng.generate(ids, GREEDY)
    for t, i, a, b in zip(texts, ids, by_text, by_ids):
        assert a.token_ids == b.token_ids and a.text == b.text and len(a.token_ids) == 8
        assert a.num_prompt_tokens == b.num_prompt_tokens == len(i)
        assert a.finish_reason == b.finish_reason == "length"
    assert by_text[0].token_ids != by_text[2].token_ids  # the outputs belong to their own prompts


def test_generate_with_per_prompt_params(eng):
    outs = eng.generate([prompt(5), prompt(5)], [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                                 SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [2, 5]


def test_generate_rejects_a_bad_prompt_without_leaving_orphans(eng):
    with pytest.raises(ValueError):
        eng.generate([prompt(5), prompt(MAX_LEN + 1)], GREEDY)
    orphaned = eng.has_unfinished()
    drain(eng)  # keep the shared engine clean for the next tests either way
    assert not orphaned, "the valid prompt before the bad one was left running, its output unreachable"


def test_generate_rejects_mismatched_params(eng, monkeypatch):
    real_step, calls = eng.step, []

    def step():
        calls.append(1)
        if len(calls) > 100:
            raise RuntimeError("generate() keeps stepping an engine with nothing left to do")
        return real_step()

    monkeypatch.setattr(eng, "step", step)
    try:
        with pytest.raises(ValueError):
            eng.generate([prompt(5), prompt(5), prompt(5)], [GREEDY, GREEDY])
    finally:
        monkeypatch.undo()
        drain(eng)


# -- step outputs --------------------------------------------------------------------------------


def test_step_outputs_only_for_requests_that_advanced(eng):
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("long", prompt(100), p)  # prefilled in 32-token chunks: silent for several steps
    eng.add_request("short", prompt(3), p)
    for i in range(4):
        eng.add_request(f"queued{i}", prompt(4), p)  # max_num_seqs=4: some wait
    seen_silent, seen_announced = set(), set()
    for _ in range(200):
        if not eng.has_unfinished():
            break
        before = {rid: r.num_tokens for rid, r in eng.requests.items()}
        outs = eng.step()
        ids = [o.request_id for o in outs]
        assert len(ids) == len(set(ids)), "one output per request per step"
        advanced = {rid for rid, n in before.items() if rid not in eng.requests or eng.requests[rid].num_tokens > n}
        announced = {o.request_id for o in outs if not o.new_token_ids}
        assert set(ids) - announced == advanced
        for o in outs:
            assert len(o.new_token_ids) == 1 or (o.text_delta == "" and not o.finished), "only a start is empty"
        assert not announced & seen_announced, "a request is announced once"
        seen_announced |= announced
        seen_silent |= set(before) - advanced - announced
    assert not eng.has_unfinished()
    assert {"long", "queued3"} <= seen_silent  # the test did see requests that had to stay quiet
    assert "long" in seen_announced  # its first chunk said it had started


# -- kernels ------------------------------------------------------------------------------------


def test_cpu_engine_runs_the_native_attention(engine):
    """With a C++ compiler present (CI has one), CPU attention is the native kernel, not the torch twin."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler")
    assert engine.attention_backend == "cpu-native"


def test_a_request_whose_output_fails_outside_the_model_fails_alone(isolated):
    """Its detokenizer raises from its third token: it ends at once (finished, `error` says why), its blocks are
    freed, and the others produce exactly what they produce without it."""
    bystanders = _bystanders()
    clean_eng = isolated()
    for rid, ids, p in bystanders:
        clean_eng.add_request(rid, ids, p)
    clean, _ = _run_to_end(clean_eng)

    eng = isolated()
    requests = list(bystanders)
    requests.insert(2, ("bad", prompt(15), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    for rid, ids, p in requests:
        eng.add_request(rid, ids, p)
    bad = eng.requests["bad"]
    add_token = bad.detok.add_token

    def broken(token):
        if bad.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "this request's text cannot be decoded")
        return add_token(token)

    bad.detok.add_token = broken
    tokens, ended = {}, {}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                ended[o.request_id] = (o.finish_reason, o.error)
    assert ended["bad"][0] == "abort" and "UnicodeDecodeError" in ended["bad"][1]
    assert {rid: t for rid, t in tokens.items() if rid != "bad"} == clean
    assert all(e == ("length", None) for rid, e in ended.items() if rid != "bad")
    eng.check_integrity()
    assert eng.stats()["num_free_kv_blocks"] == eng.stats()["num_kv_blocks"]
