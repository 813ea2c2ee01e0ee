"""Graceful degradation under KV pressure (engine/pressure.py and the `mixed` admission gate in engine/scheduler.py):
the ladder's rules on their own, the gate without a model, then a real tiny engine whose pool is far too small
degrading, recovering, losing nothing and computing exactly what an unpressured engine computes."""
from __future__ import annotations

import logging

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.pressure import CALM_STEPS, FREE_WATERMARK, HOLD_AT, STATIC_AT, WINDOW_STEPS, PressureLadder
from engine.request import Status
from tests.engine.test_scheduler import fake_step, make, req

# -- the ladder's rules ---------------------------------------------------------------------


def test_the_ladder_climbs_one_rung_per_burst_and_steps_down_only_when_calm_and_free(caplog):
    lad, blocks = PressureLadder(100), 100
    preempted = steps = 0

    def step(new: int = 0, free: int = blocks, running: int = 4) -> str:
        nonlocal preempted, steps
        preempted += new
        steps += 1
        lad.observe(preempted, free, running)
        return lad.mode

    with caplog.at_level(logging.INFO, logger="sluice.scheduler"):
        assert all(step() == "normal" for _ in range(3 * CALM_STEPS)), "no preemption, no change"
        assert step(HOLD_AT) == "hold"
        assert step(STATIC_AT - 1, free=0) == "hold", "a climb needs preemptions under the new mode"
        assert step(1, free=0) == "static"
        assert all(step(free=int(FREE_WATERMARK * blocks) - 1) == "static" for _ in range(CALM_STEPS + 5)), \
            "calm, but too few blocks free"
        assert step(1, free=0) == "static"  # too few to climb (and nothing above static), but calm starts over
        last = steps
        assert all(step() == "static" for _ in range(CALM_STEPS - 1)), "free, but not calm for long enough"
        assert step() == "hold" and steps - last == CALM_STEPS
        assert all(step() == "hold" for _ in range(CALM_STEPS - 1)), "each rung waits a calm period of its own"
        assert step() == "normal"
    assert lad.num_changes == 4 and lad.level == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "sluice.scheduler"]
    assert [line.split(":")[0] for line in lines] == [
        "scheduler mode normal -> hold", "scheduler mode hold -> static",
        "scheduler mode static -> hold", "scheduler mode hold -> normal"]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_only_preemptions_within_the_window_climb():
    assert STATIC_AT > 2
    lad, n = PressureLadder(100), HOLD_AT
    lad.observe(n, 0, 4)
    assert lad.mode == "hold"
    for _ in range(2 * STATIC_AT):  # one preemption per half window: never STATIC_AT of them in one window
        for _ in range(WINDOW_STEPS // 2):
            lad.observe(n, 0, 4)
        n += 1
        lad.observe(n, 0, 4)
        assert lad.mode == "hold"
    for _ in range(STATIC_AT - 1):  # as many within a window do climb
        n += 1
        lad.observe(n, 0, 4)
    assert lad.mode == "static"


def test_a_drained_static_batch_and_an_idle_scheduler_step_down():
    lad = PressureLadder(100)
    lad.observe(HOLD_AT, 0, 4)
    lad.observe(HOLD_AT + STATIC_AT, 0, 4)
    assert lad.mode == "static"
    lad.observe(HOLD_AT + STATIC_AT, 0, 0)
    assert lad.mode == "hold", "nothing runs: the static batch is over"
    lad.settle()
    assert lad.mode == "normal" and lad.num_changes == 4


# -- the admission gate, without a model ---------------------------------------------------


def _with_one_running(mode: str) -> tuple:
    """A mixed scheduler over 16 blocks whose one running request holds 3 of them, its mode pinned to `mode`."""
    max_len = 256
    sched = make(max_model_len=max_len, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8)
    runner = req(40, 200)
    sched.add(runner)
    fake_step(sched, max_len)
    sched.pressure.observe = lambda *a: None  # NOTE: the mode is pinned here; the ladder's rules are tested above
    sched.pressure.mode = mode
    assert sched.bm.num_free_blocks == 13
    return sched, runner, max_len


def test_hold_admits_the_head_only_once_all_of_it_fits_and_nobody_jumps_the_queue():
    sched, runner, max_len = _with_one_running("hold")
    head = req(16 * 12, 4)  # 12 blocks, and one block of growth for the running request: fits
    sched.add(head)
    assert head in fake_step(sched, max_len).reqs

    sched, runner, max_len = _with_one_running("hold")
    head, small = req(16 * 13, 4), req(5, 4)  # 13 blocks: nothing left for the running request to grow into
    sched.add(head)
    sched.add(small)
    for _ in range(3):
        rec = fake_step(sched, max_len)
        assert rec.reqs == [runner], "the head waits, and so does everything behind it"
    assert head.status is small.status is Status.WAITING
    sched.pressure.mode = "normal"
    assert head in fake_step(sched, max_len).reqs, "normal admits a first chunk that fits"


@pytest.mark.parametrize("mode", ["hold", "static"])
def test_an_empty_running_set_always_admits(mode):
    sched, runner, max_len = _with_one_running(mode)
    head, small = req(16 * 15, 4), req(5, 4)
    sched.add(head)
    sched.add(small)
    assert fake_step(sched, max_len).reqs == [runner]
    sched.finish(runner, "abort")
    rec = fake_step(sched, max_len)
    assert rec.reqs[0] is head, "nothing runs: the head is admitted in any mode, or it would wait forever"
    assert small not in rec.reqs, "and the gate closes behind it"


def test_a_burst_that_ends_degraded_leaves_the_scheduler_normal():
    max_len = 256
    sched = make(max_model_len=max_len, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=16)
    for _ in range(16):
        sched.add(req(20, 80))
    modes = []
    while sched.has_unfinished():
        modes.append(sched.pressure.mode)  # before the step: its last one finishes the burst
        fake_step(sched, max_len)
    assert modes[-1] != "normal", "the burst was meant to end under pressure"
    assert sched.pressure.mode == "normal", "nothing left to run: nothing to wait out"


@pytest.mark.parametrize("policy", ["prefill_first", "static"])
def test_the_baselines_never_change_mode(policy):
    max_len = 256
    sched = make(max_model_len=max_len, num_blocks=16, scheduling=policy, max_num_batched_tokens=64, max_num_seqs=16)
    for _ in range(12):
        sched.add(req(10, 60))
    while sched.has_unfinished():
        fake_step(sched, max_len)
    assert sched.num_preemptions > 0, "the pool was meant to run out"
    assert sched.pressure.mode == "normal" and sched.pressure.num_changes == 0


# -- a real tiny engine --------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def _burst() -> list[tuple[str, list[int], SamplingParams]]:
    """31 short requests, greedy and seeded, and one long one that keeps running after them (so the engine
    recovers while it still has work); 32 x 70 tokens against a pool of 24 x 16."""
    reqs = [(f"b{i}", [3 + (i * 37 + j * 11) % 900 for j in range(10)], GREEDY) for i in range(29)]
    reqs += [(f"s{i}", [5 + (i * 13 + j * 7) % 900 for j in range(10)],
              SamplingParams(max_tokens=60, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True)) for i in range(2)]
    reqs.append(("long", [11 + j * 3 % 900 for j in range(10)], SamplingParams(max_tokens=180, temperature=0.0,
                                                                               ignore_eos=True)))
    return reqs


def _engine(tiny_model_dir, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=num_kv_blocks,
                                  max_model_len=384, max_num_batched_tokens=64, max_num_seqs=32))


def _run(eng: LLMEngine, reqs) -> tuple[dict[str, list[int]], dict[str, str | None], list[tuple[str, bool]]]:
    """Steps until idle; returns tokens and finish reasons per request, and (mode, still busy) after each step."""
    for rid, ids, p in reqs:
        eng.add_request(rid, ids, p)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    reasons: dict[str, str | None] = {}
    modes = []
    for _ in range(2000):
        if not eng.has_unfinished():
            return tokens, reasons, modes
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        eng.check_integrity()
        modes.append((eng.scheduler.pressure.mode, eng.has_unfinished()))
    raise AssertionError("engine did not drain")


def _changes(modes: list[tuple[str, bool]]) -> list[str]:
    seq = ["normal"]
    for m, _ in modes:
        if m != seq[-1]:
            seq.append(m)
    return seq


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The burst on a pool that holds all of it: no preemption, no mode change."""
    eng = _engine(tiny_model_dir, 512)
    tokens, reasons, modes = _run(eng, _burst())
    return eng, tokens, reasons, modes


def test_a_big_pool_never_degrades(reference):
    eng, _, reasons, modes = reference
    assert eng.scheduler.num_preemptions == 0
    assert {m for m, _ in modes} == {"normal"} and eng.scheduler.pressure.num_changes == 0
    assert set(reasons.values()) == {"length"}


def test_a_tiny_pool_degrades_recovers_and_computes_what_a_big_one_does(tiny_model_dir, reference, caplog):
    _, ref_tokens, _, _ = reference
    eng = _engine(tiny_model_dir, 24)
    with caplog.at_level(logging.INFO, logger="sluice.scheduler"):
        tokens, reasons, modes = _run(eng, _burst())
    sched = eng.scheduler
    assert sched.num_preemptions > 0, "the pool was meant to run out"
    # NOTE: every rung, climbing and descending; the last step down happens while the long request still runs
    assert _changes(modes) == ["normal", "hold", "static", "hold", "normal"]
    recovered = [busy for m, busy in modes[modes.index(("static", True)):] if m == "normal"]
    assert recovered and recovered[0], "recovered by calm while work remained, not merely because it ran dry"
    lines = [r.getMessage() for r in caplog.records if r.name == "sluice.scheduler"]
    assert len(lines) == sched.pressure.num_changes == 4
    assert "normal -> hold" in lines[0] and "hold -> static" in lines[1] and "static -> hold" in lines[2]
    assert "hold -> normal" in lines[3]
    # nothing lost, nothing changed: every request ran to its max_tokens with the tokens of the unpressured run
    assert reasons == {rid: "length" for rid in ref_tokens}
    assert tokens == ref_tokens
    assert not sched.running and not sched.waiting
    eng.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks

    # a light request afterwards runs in normal mode and changes nothing
    more, _, after = _run(eng, [("light", [3, 4, 5, 6], GREEDY)])
    assert len(more["light"]) == 60 and {m for m, _ in after} == {"normal"} and sched.pressure.num_changes == 4
