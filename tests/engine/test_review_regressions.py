"""Review repros (engine/). Each test FAILS on the reviewed commit and passes once the finding is fixed."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, StepError
from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.request import Request
from engine.scheduler import Scheduler


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                                  max_num_batched_tokens=64, max_num_seqs=4))


def _drain(eng: LLMEngine) -> tuple[dict[str, str], list[str]]:
    reasons, failed = {}, []
    for _ in range(200):
        if not eng.has_unfinished():
            break
        try:
            for o in eng.step():
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
        except StepError as e:
            failed += e.request_ids
    return reasons, failed


# F1: a client-chosen top_k that does not fit int64 (WS `top_k: ge=0`, OpenAI `top_k: ge=0`, SamplingParams
# `top_k >= -1`: no upper bound anywhere) makes the sampler's torch.tensor() raise inside runner.run, so the
# whole step fails and every co-scheduled request of every other client is aborted with `internal`.
def test_huge_top_k_does_not_fail_other_requests(engine):
    engine.add_request("victim", [5] * 10, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    try:
        engine.add_request("evil", [6] * 10, SamplingParams(max_tokens=4, temperature=1.0, top_k=10**30,
                                                             ignore_eos=True))
    except ValueError:
        pass  # rejecting it up front is a fine fix
    reasons, failed = _drain(engine)
    assert "victim" not in failed, f"an innocent request was failed by another request's top_k: {failed}"
    assert reasons.get("victim") == "length"
    engine.check_integrity()


# F2: `static` (and `prefill_first`) go through _admit, which stops at max_num_partial_prefills (default 4)
# prompts with remaining > 1 -- a `mixed`-only limit on prompts *mid-prefill across steps*. The static
# baseline therefore forms batches of 4, not of everything waiting (up to max_num_seqs): the bench's
# first-generation baseline is ~max_num_seqs/4 times slower than the thing it claims to model.
@pytest.mark.parametrize("policy", ["static", "prefill_first"])
def test_whole_prompt_policies_admit_more_than_max_num_partial_prefills(policy):
    cfg = EngineConfig(scheduling=policy, max_num_seqs=16, max_num_batched_tokens=2048)
    sched = Scheduler(cfg, BlockManager(256, 16), max_model_len=512)
    for i in range(8):
        sched.add(Request(f"r{i}", [10 + i] * 20, SamplingParams(max_tokens=4), 4))
    batch = sched.schedule()
    assert len(batch) == 8, f"{policy}: one prefill step admitted {len(batch)} of 8 waiting 20-token prompts"


class _ByteTokenizer:
    """Token i decodes to VOCAB[i] (bytes), like a byte-level BPE with a merge that ends mid-character."""

    VOCAB = {0: b"x", 1: b"STOP\xe6", 2: b"\x97\xa5"}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return b"".join(self.VOCAB[i] for i in ids).decode("utf-8", errors="replace")


# F3: a token whose text holds a stop string and then ends mid-UTF-8 is parked (full ends with U+FFFD) without
# the stop-string check; if the request then ends by length/EOS, engine._append_token calls flush(), which
# appends the parked text unchecked, and delta(True) emits the stop string: docs/protocol.md §4 "never any part of
# a matched stop string".
def test_flush_never_emits_a_stop_string():
    d = IncrementalDetokenizer(_ByteTokenizer(), [0], ["STOP"])
    assert d.add_token(1) is False  # what the engine sees, then max_tokens is reached on this token:
    d.flush()
    out = d.delta(True)
    assert "STOP" not in out, f"completion text {out!r} contains the stop string"


# F4: ModelRunner reuses its pinned host buffers every step and copies them with non_blocking=True. Only
# a step that samples synchronises (tokens.tolist()); after a prefill-only step the next _metadata()
# overwrites input_ids/positions/slot_mapping/block_tables while the previous step's H2D copies may still
# be queued behind earlier GPU work -> wrong tokens, and KV written into other requests' (cached) blocks.
# Simulated here by a long GPU sleep in front of every forward (what a big model's chunk does).
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_only_steps_do_not_race_on_pinned_buffers(tiny_model_dir):
    def run(slow: bool) -> list[int]:
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=64,
                                     max_model_len=512, max_num_batched_tokens=16))
        if slow:
            fwd = eng.model.forward

            def slow_forward(*a, **k):
                torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the forward
                return fwd(*a, **k)

            eng.model.forward = slow_forward
        prompt = [3 + (i * 37) % 1000 for i in range(300)]  # ~19 prefill-only steps in a row
        return eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids

    assert run(slow=True) == run(slow=False)


def _eng(tiny_model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(tiny_model_dir), "dtype": "float32", "num_kv_blocks": 64,
                                     "block_size": 4, "max_num_batched_tokens": 64, "prefix_store": False, **kw}))


# A request admitted in a step that failed for another (StepError) stayed running with its prompt not computed:
# prefill_first and static compute a prompt only in the step that admits it, so it was never scheduled again (hung,
# holding its blocks). Under async scheduling the failed step's batch was cut down before recovery, losing them too.
@pytest.mark.parametrize("policy", ["prefill_first", "static", "mixed"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_admitted_in_a_failed_step_is_admitted_again(tiny_model_dir, policy, async_scheduling):
    eng = _eng(tiny_model_dir, scheduling=policy, async_scheduling=async_scheduling)
    run, launch = eng.runner.run, eng.runner.launch

    def poisoned(batch) -> bool:
        return any(r.request_id == "bad" for r in batch.reqs)

    def run_or_fail(batch, samples):
        if poisoned(batch):
            raise RuntimeError("bad poisons the forward")
        return run(batch, samples)

    def launch_or_fail(batch, samples, *args):
        forward = launch(batch, samples, *args)
        if not poisoned(batch):
            return forward

        def fails():
            raise RuntimeError("bad poisons the forward")
        return fails

    eng.runner.run, eng.runner.launch = run_or_fail, launch_or_fail
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("good", list(range(10, 20)), p)
    eng.add_request("bad", list(range(30, 40)), p)
    reasons, failed = _drain(eng)
    assert failed == ["bad"] and reasons == {"good": "length"}, (reasons, failed)
    assert eng.stats()["num_free_kv_blocks"] == eng.stats()["num_kv_blocks"]
    eng.check_integrity()


# A host-tier hit is cached on the device at allocation, its copy back made after scheduling: a failure between the
# two (outside the model), then `rebuilt(keep_cache=True)`, adopted the block as cached with its KV never loaded.
def test_a_rebuilt_engine_does_not_adopt_blocks_never_loaded_from_the_host_tier(tiny_model_dir):
    cfg = dict(num_kv_blocks=16, kv_offload_gb=0.001, max_model_len=48)
    prompt, greedy = list(range(100, 113)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = _eng(tiny_model_dir, **cfg).generate([prompt], greedy)[0].token_ids
    eng = _eng(tiny_model_dir, **cfg)
    eng.generate([prompt], greedy)
    for i in range(4):  # the prompt's blocks pushed out of the pool, into the host tier
        eng.generate([list(range(200 + 40 * i, 240 + 40 * i))], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.add_request("B", prompt, greedy)
    eng.add_request("C", list(range(600, 610)), greedy)
    may_admit = eng.scheduler._may_admit

    def fails_for_c(req):
        if req.request_id == "C":
            raise RuntimeError("a scheduler failure (outside the model)")
        return may_admit(req)

    eng.scheduler._may_admit = fails_for_c
    with pytest.raises(RuntimeError, match="scheduler failure"):
        eng.step()
    assert eng.block_manager._loads  # (B's hits from the host: decided, their copies not made)
    new = eng.rebuilt(keep_cache=True)
    assert new.generate([prompt], greedy)[0].token_ids == reference
    new.check_integrity()


# A resumed request's prefix hit covered its checkpoint's output tokens: num_cached_tokens over its prompt's
# tokens, and prefix_cache_hits over prefix_cache_queries (a hit rate above 1 in /metrics).
def test_a_resumed_requests_cached_tokens_are_its_prompts(tiny_model_dir):
    from engine import Checkpoint

    eng = _eng(tiny_model_dir)
    prompt, p = list(range(10, 18)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    out = eng.generate([prompt], p)[0].token_ids
    before = eng.stats()
    eng.add_request("b", prompt, p, resume=Checkpoint(out[:20], 0, None))
    first = None
    while eng.has_unfinished():
        for o in eng.step():
            first = first or o
    assert first.num_prompt_tokens == 8 and first.num_cached_tokens <= 8
    s = eng.stats()
    assert s["prefix_cache_hits"] <= s["prefix_cache_queries"]
    assert s["prefix_cache_queries"] == before["prefix_cache_queries"]  # (counted where it started)
