"""Checkpoint and replay in the engine (docs/architecture.md §11): a request resumed in a rebuilt engine from what its
caller was given goes on exactly as it would have in the engine that failed, whatever the sampling; a device that
fails everything is reported as such, its requests intact."""
from __future__ import annotations

import pytest

from engine import Checkpoint, DeviceError, EngineConfig, LLMEngine, SamplingParams, StructuredOutput

MAX_LEN = 256
N = 24  # tokens per request


@pytest.fixture(scope="module")
def make(tiny_model_dir):
    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128,
                                      max_model_len=MAX_LEN, max_num_batched_tokens=32, max_num_seqs=8))
    return make


def _prompt(i: int, n: int = 12) -> list[int]:
    return [3 + (i * 7919 + j * 31) % 1000 for j in range(n)]


def _requests(stop: str) -> list[tuple[str, list[int], SamplingParams]]:
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    return [
        ("greedy", _prompt(1, 40), greedy),  # a prompt longer than a step's budget: chunked again on resume
        ("penalized", _prompt(2), SamplingParams(max_tokens=N, temperature=0.0, repetition_penalty=1.3,
                                                 frequency_penalty=0.5, ignore_eos=True)),
        ("seeded", _prompt(3), SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
        ("seeded-penalized", _prompt(4), SamplingParams(max_tokens=N, temperature=1.0, seed=8, presence_penalty=1.0,
                                                        ignore_eos=True)),
        ("stop", _prompt(5), SamplingParams(max_tokens=N, temperature=0.0, stop=[stop], ignore_eos=True)),
        ("logprobs", _prompt(6), SamplingParams(max_tokens=N, temperature=0.0, logprobs=2, ignore_eos=True)),
        # its grammar's matcher is where the checkpoint's tokens left it, in the resumed engine too
        ("structured", _prompt(7), SamplingParams(max_tokens=N, temperature=1.0, seed=9, structured_output=StructuredOutput(
            "json", '{"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}'))),
        # the stop string shows up in its first min_tokens: ignored there, in the resumed engine too
        ("min-tokens", _prompt(5), SamplingParams(max_tokens=N, temperature=0.0, stop=[stop], min_tokens=N - 4,
                                                  ignore_eos=True)),
    ]


def _run(eng: LLMEngine, acc: dict[str, list], until=lambda acc: False) -> None:
    """Steps `eng` until it drains or `until(acc)`; acc[rid] = [token ids, text, checkpoint, finish_reason]."""
    for _ in range(1000):
        if not eng.has_unfinished() or until(acc):
            return
        for o in eng.step():
            a = acc.setdefault(o.request_id, [[], "", Checkpoint(), None])
            a[0] += o.new_token_ids
            a[1] += o.text_delta
            a[2].advance(o.new_token_ids, o.text_delta, o.rng_state)
            a[3] = o.finish_reason if o.finished else None
    raise AssertionError("the engine did not drain")


def _stop_string(make) -> str:
    """Three characters from the middle of what the `stop` request writes without a stop string."""
    eng = make()
    text = eng.generate([_prompt(5)], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0].text
    assert len(text) > 10
    return text[len(text) // 2 : len(text) // 2 + 3]


@pytest.mark.parametrize("resume_after", [1, 5])
def test_resumed_requests_go_on_as_if_nothing_happened(make, resume_after):
    stop = _stop_string(make)
    reqs = _requests(stop)
    clean_eng, clean = make(), {}
    for rid, ids, p in reqs:
        clean_eng.add_request(rid, ids, p)
    _run(clean_eng, clean)

    first, given = make(), {}
    for rid, ids, p in reqs:
        first.add_request(rid, ids, p)
    # stop mid-stream: every request has `resume_after` tokens or more (and the stop request has not stopped yet)
    _run(first, given, until=lambda acc: len(acc) == len(reqs) and all(len(a[0]) >= resume_after for a in acc.values()))
    assert all(a[3] is None for a in given.values())
    second = first.rebuilt()
    assert second.model is first.model and second.runner.kv_caches and not first.runner.kv_caches  # pool let go
    counted = first.stats()
    assert second.stats()["generation_tokens"] == counted["generation_tokens"] > 0  # counters go on
    for rid, ids, p in reqs:
        second.add_request(rid, ids, p, resume=given[rid][2].copy())
    after = {}
    _run(second, after)
    for rid, _, _ in reqs:
        tokens, text, _, reason = clean[rid]
        assert given[rid][0] + after[rid][0] == tokens, rid
        assert given[rid][1] + after[rid][1] == text, rid
        assert after[rid][3] == reason, rid
    assert clean["stop"][3] == "stop" and stop not in clean["stop"][1]  # the stop string matched after the resume
    assert stop in clean["min-tokens"][1] and len(clean["min-tokens"][0]) > N - 4
    second.check_integrity()
    assert second.stats()["num_free_kv_blocks"] == second.stats()["num_kv_blocks"]


def test_a_checkpoint_that_cannot_be_resumed_is_refused(make):
    eng = make()
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="leaves no room"):
        eng.add_request("done", _prompt(1), p, resume=Checkpoint([5, 6, 7, 8], 0))
    with pytest.raises(ValueError, match="claims 1000 characters"):
        eng.add_request("chars", _prompt(1), p, resume=Checkpoint([5, 6], 1000))
    assert not eng.requests and not eng.has_unfinished()


def test_a_device_that_fails_everything_raises_device_error_and_keeps_the_requests(make, monkeypatch):
    """When every computation fails, down to a trivial one, no request is to blame: none is dropped."""
    eng = make()
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"r{i}", _prompt(10 + i), p)
    eng.step()

    def dead(batch, samples):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(eng.runner, "run", dead)
    monkeypatch.setattr(eng.runner, "device_ok", lambda: False)
    with pytest.raises(DeviceError, match="illegal memory access"):
        eng.step()
    assert set(eng.requests) == {"r0", "r1", "r2"}

    monkeypatch.setattr(eng.runner, "device_ok", lambda: True)  # the device works: the requests are to blame
    from engine import StepError
    with pytest.raises(StepError):
        eng.step()
    assert not eng.requests
    drain = [eng.step() for _ in range(3)]
    assert drain == [[], [], []]  # the culprits were reported by their StepError, not as outputs
    assert not eng.has_unfinished()


def test_a_rebuilt_engine_keeps_the_layout_and_starts_calm(make):
    """Same blocks and max_model_len (what checkpoints were made under); the old engine's preemptions are not new
    pressure for the new one; the old pools are let go."""
    eng = LLMEngine(EngineConfig(model=make().config.model, dtype="float32", num_kv_blocks=12, max_model_len=128,
                                 max_num_batched_tokens=32, max_num_seqs=8, kv_offload_gb=0.001))
    outs = eng.generate([_prompt(i, 30) for i in range(6)], SamplingParams(max_tokens=40, temperature=0.0,
                                                                         ignore_eos=True))
    assert len(outs) == 6 and eng.stats()["num_preemptions"] > 0
    new = eng.rebuilt()
    assert new.layout == eng.layout and not eng.runner.kv_caches and not eng.runner.host_caches
    assert new.stats()["num_preemptions"] == eng.stats()["num_preemptions"]
    new.generate([_prompt(50)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert new.scheduler.pressure.mode == "normal"
    assert new.stats()["scheduler_mode_changes"] == eng.stats()["scheduler_mode_changes"]


@pytest.mark.parametrize("eviction", ["lru", "slru"])
def test_a_rebuilt_engine_that_keeps_the_cache_resumes_from_it(make, eviction):
    """After a failure outside the model the old pool's KV is sound: the new engine keeps it and the prefix cache,
    so resumed requests find their prompts and given tokens there, and go on exactly as the unfaulted run."""
    reqs = _requests("\x00never")
    clean_eng, clean = make(), {}
    for rid, ids, p in reqs:
        clean_eng.add_request(rid, ids, p)
    _run(clean_eng, clean)

    first = LLMEngine(EngineConfig(**{**vars(make().config), "kv_eviction": eviction}))
    given = {}
    for rid, ids, p in reqs:
        first.add_request(rid, ids, p)
    _run(first, given, until=lambda acc: len(acc) == len(reqs) and all(len(a[0]) >= 18 for a in acc.values()))
    second = first.rebuilt(keep_cache=True)
    assert second.runner.kv_caches and not first.runner.kv_caches  # the pool moved over
    second.check_integrity()
    for rid, ids, p in reqs:
        second.add_request(rid, ids, p, resume=given[rid][2].copy())
        req = second.requests[rid]  # every full block of its prompt and given tokens is in the kept cache
        assert len(second.block_manager.match_prefix(req)) == (req.num_tokens - 1) // 16, rid
    before = second.stats()["prompt_tokens_computed"]
    after = {}
    _run(second, after)
    for rid, _, _ in reqs:
        assert given[rid][0] + after[rid][0] == clean[rid][0], rid
        assert given[rid][1] + after[rid][1] == clean[rid][1], rid
    # each request recomputed at most its last partial block (plus one token), not its prompt and tokens
    assert second.stats()["prompt_tokens_computed"] - before <= len(reqs) * 16
    second.check_integrity()
    assert second.stats()["num_free_kv_blocks"] == second.stats()["num_kv_blocks"]
