"""Clients share the running seats (engine/scheduler.py `_admission_order`, `_rebalance`), without a model, as in
test_scheduler.py (test_correctness.py: the tokens under these preemptions are transformers')."""
from __future__ import annotations

import pytest

from engine.request import Request, SamplingParams, Status
from tests.engine.test_scheduler import fake_step, make, run_until_done

_n = iter(range(1, 10**9))


def _req(client: str, prompt_len: int = 6, max_tokens: int = 200, **params) -> Request:
    base = next(_n) * 100_000  # distinct prompts: nothing shared from the prefix cache
    return Request(f"{client}{base}", [base + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, **params), max_tokens, client)


def test_a_client_that_fills_every_seat_gives_one_to_another_at_the_next_step():
    """Four seats, all taken by long requests of client a (four more of its own waiting): b's request starts at the
    next step, a's youngest preempted and queued first among a's; nothing counts as KV pressure. Before, b waited
    for one of a's 200-token requests to end."""
    sched = make(max_num_seqs=4)
    hog = [_req("a") for _ in range(8)]
    for r in hog:
        sched.add(r)
    fake_step(sched, 1024)
    assert list(sched.running) == hog[:4]
    b = _req("b")
    sched.add(b)
    rec = fake_step(sched, 1024)
    assert b in rec.reqs and b.status is Status.RUNNING
    assert list(sched.running) == [*hog[:3], b]
    assert list(sched.waiting) == hog[3:], "a's preempted request waits first among a's"
    assert sched.num_fair_preemptions == 1 and sched.num_preemptions == 0 and sched.pressure.mode == "normal"
    run_until_done(sched, 1024)
    assert b.finish_reason == "length" and all(r.num_output_tokens == r.max_tokens for r in [*hog, b])
    assert sched.num_fair_preemptions == 1, "one seat was taken once; a did not take it back"
    assert not sched.clients


def test_one_client_is_never_preempted_for_itself_and_keeps_its_order():
    sched = make(max_num_seqs=2)
    reqs = [_req("a", max_tokens=20) for _ in range(6)]
    for r in reqs:
        sched.add(r)
    starts = []
    while sched.has_unfinished():
        starts += [r for r in fake_step(sched, 1024).reqs if r not in starts]
    assert starts == reqs and sched.num_fair_preemptions == 0


def test_waiting_clients_take_turns():
    """a queued five requests before b queued five: the step that admits them takes a, b, a, b, ... (a first: it
    queued first), not all of a's first."""
    sched = make(max_num_seqs=6)
    a, b = [_req("a") for _ in range(5)], [_req("b") for _ in range(5)]
    for r in a + b:
        sched.add(r)
    rec = fake_step(sched, 1024)
    assert rec.reqs == [a[0], b[0], a[1], b[1], a[2], b[2]]


def test_seats_settle_at_an_even_share_without_churn():
    """Two clients with more requests than seats: each holds two of four, taken from a once (b arrived when a held
    all four: one preemption gives b one seat, a second one gives it two); never more."""
    sched = make(max_num_seqs=4)
    for _ in range(6):
        sched.add(_req("a", max_tokens=50))
    fake_step(sched, 1024)
    for _ in range(6):
        sched.add(_req("b", max_tokens=50))
    for _ in range(30):
        fake_step(sched, 1024)
        if sched.num_fair_preemptions == 2:
            break
    for _ in range(20):
        fake_step(sched, 1024)
        assert sorted(r.client for r in sched.running) == ["a", "a", "b", "b"]
    run_until_done(sched, 1024)
    assert sched.num_fair_preemptions == 2 and sched.num_preemptions == 0


def test_a_client_whose_requests_hold_the_kv_blocks_gives_another_room_for_its_first_chunk():
    """Eight seats but KV for only a's four long requests: b's prompt starts at the next step."""
    sched = make(max_model_len=256, num_blocks=16, block_size=16, max_num_seqs=8)
    hog = [_req("a", prompt_len=60, max_tokens=150) for _ in range(4)]  # 4 blocks each: the pool
    for r in hog:
        sched.add(r)
    fake_step(sched, 256)
    assert sched.bm.num_free_blocks == 0 and len(sched.running) == 4
    b = _req("b", prompt_len=20)
    sched.add(b)
    rec = fake_step(sched, 256)
    assert b in rec.reqs and sched.num_fair_preemptions == 1 and hog[3].status is Status.WAITING
    run_until_done(sched, 256)
    assert all(r.finish_reason == "length" for r in [*hog, b])


def test_room_for_a_first_chunk_counts_what_the_prefix_cache_holds():
    """a's 13 requests share a 48-token system prompt (3 blocks) and hold the rest of the 16-block pool, a block
    each. b's prompt is that system prompt and 4 tokens: its first chunk takes one fresh block, so one of a's
    requests is preempted for it. Before, the room was counted as if nothing were cached (4 blocks): four were."""
    sched = make(max_model_len=256, num_blocks=16, block_size=16, max_num_seqs=16)
    system = [9_000_000 + i for i in range(48)]

    def chat(client: str, tail: int, max_tokens: int) -> Request:
        base = next(_n) * 100_000
        prompt = system + [base + i for i in range(tail)]
        return Request(f"{client}{base}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, client)

    hog = [chat("a", 12, 3) for _ in range(13)]  # 60 tokens: up to 63 with their output, in their 4th block
    for r in hog:
        sched.add(r)
    while any(r.status is Status.WAITING for r in hog):
        fake_step(sched, 256)
    assert sched.bm.num_free_blocks == 0 and len(sched.running) == 13
    b = chat("b", 4, 3)
    sched.add(b)
    rec = fake_step(sched, 256)
    assert b in rec.reqs and sched.num_fair_preemptions == 1, sched.num_fair_preemptions
    run_until_done(sched, 256)
    assert all(r.finish_reason == "length" for r in [*hog, b])


def test_the_seat_taken_is_held_for_its_request():
    """b's request wants its prompt's logprobs, and a's long prompt takes every row of them a step has for many
    steps: b is passed over (it waits, keeping its place) while the seat taken for it stays its own, not a's
    again to be taken back at the next step, one preemption a step; b runs once rows are free."""
    sched = make(max_num_seqs=3, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    sched.prompt_logprob_rows = 32
    long = _req("a", prompt_len=400, prompt_logprobs=1)
    hog = [long, _req("a"), _req("a")]
    for r in hog:
        sched.add(r)
    fake_step(sched, 1024)
    assert list(sched.running) == hog
    b = _req("b", prompt_len=20, prompt_logprobs=1)
    sched.add(b)
    rec = fake_step(sched, 1024)
    assert b not in rec.reqs and hog[2].status is Status.WAITING and len(sched.running) == 2
    for _ in range(5):
        assert b not in fake_step(sched, 1024).reqs and len(sched.running) == 2
    while b.status is Status.WAITING:
        fake_step(sched, 1024)
    assert sched.num_fair_preemptions == 1
    run_until_done(sched, 1024)


@pytest.mark.parametrize("mode", ["hold", "static"])
def test_under_kv_pressure_a_client_with_nothing_running_swaps_for_one_seat(mode):
    """The pressure ladder still governs admission: b, with nothing running beside a's two, is let in past the mode
    for one of a's (a swap: the running set stays the size it was), its second request waits its turn; and clients
    of one request each wait the pressure out together (`static` still admits nothing while they run)."""
    sched = make(max_num_seqs=2)
    hog = [_req("a") for _ in range(2)]
    for r in hog:
        sched.add(r)
    fake_step(sched, 1024)
    sched.pressure.mode = mode
    b1, b2 = _req("b"), _req("b")
    sched.add(b1)
    sched.add(b2)
    rec = fake_step(sched, 1024)
    assert b1 in rec.reqs and b2 not in rec.reqs and sched.num_fair_preemptions == 1
    assert list(sched.running) == [hog[0], b1]

    sched = make(max_num_seqs=8)
    for r in [_req("a"), _req("a")]:
        sched.add(r)
    fake_step(sched, 1024)
    sched.pressure.mode = "static"
    others = [_req(c) for c in "cde"]
    for r in others:
        sched.add(r)
    rec = fake_step(sched, 1024)
    assert [r for r in others if r in rec.reqs] == others[:1] and len(sched.running) == 2

    sched = make(max_num_seqs=4)
    for r in [_req(c) for c in "abc"]:
        sched.add(r)
    fake_step(sched, 1024)
    sched.pressure.mode = "static"
    late = _req("d")
    sched.add(late)
    assert late not in fake_step(sched, 1024).reqs and sched.num_fair_preemptions == 0


def test_the_baseline_policies_do_not_preempt_for_a_share():
    sched = make(max_num_seqs=2, scheduling="prefill_first")
    for r in [_req("a"), _req("a")]:
        sched.add(r)
    fake_step(sched, 1024)
    sched.add(_req("b"))
    fake_step(sched, 1024)
    assert sched.num_fair_preemptions == 0 and {r.client for r in sched.running} == {"a"}


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_under_kv_pressure_a_client_with_many_streams_gives_up_its_own(policy):
    """a's eight long streams outgrow the KV pool; b's one stream came last, so it is the youngest running request:
    the blocks the streams grow into come from a's other streams (a holds two or more more seats than b), never
    from b's, which decodes every step to its end. Everything still ends."""
    sched = make(max_model_len=512, num_blocks=48, block_size=16, max_num_seqs=16, scheduling=policy)
    hog = [_req("a", prompt_len=8, max_tokens=150) for _ in range(8)]  # 10 blocks each at the end: 80
    for r in hog:
        sched.add(r)
    for _ in range(3):
        fake_step(sched, 512)
    b = _req("b", prompt_len=8, max_tokens=120)
    sched.add(b)
    while b.status is not Status.RUNNING:
        fake_step(sched, 512)
    while b.finish_reason is None:
        rec = fake_step(sched, 512)
        assert b in rec.reqs, f"b waited a step (preemptions so far: {sched.num_preemptions})"
    assert sched.num_preemptions > 0, "the pool ran out while b ran"
    run_until_done(sched, 512)
    assert all(r.num_output_tokens == 150 for r in hog)


def test_a_prompt_wanting_its_logprobs_is_hashed_for_the_prompts_that_share_it():
    """A request that wants its prompt's logprobs takes nothing from the prefix cache, but its blocks are hashed at
    admission all the same, so a prompt sharing them in the same step waits a step and takes them from the cache
    instead of computing them twice (lost once, in a refactor; found by a review)."""
    sched = make(max_num_seqs=8, num_blocks=256)
    prefix = [5_000_000 + i for i in range(64)]  # 4 blocks
    lp = Request("lp", prefix + [1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=1), 2, "a")
    other = Request("other", prefix + [4, 5, 6], SamplingParams(max_tokens=2), 2, "b")
    sched.add(lp)
    sched.add(other)
    assert [r for r in fake_step(sched, 1024).reqs] == [lp], "other waits for the blocks lp computes"
    fake_step(sched, 1024)
    assert other.num_cached_tokens == 64
