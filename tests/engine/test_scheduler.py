"""Scheduler unit tests, without a model: a step is `schedule()`, `postprocess()`, then a fake sampled
token for every request whose step reached its last token (docs/architecture.md §4)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Request, SamplingParams, Status
from engine.scheduler import RequestQueue, Scheduler


@dataclass
class StepRecord:
    """What one step scheduled, captured before `postprocess` moves the requests on."""

    entries: list[tuple[Request, int, bool]]  # (request, new tokens, sampled)
    prefilling: list[bool]  # per entry: more than one token lacked KV before the step
    admitted: list[bool]  # per entry: admitted from the waiting queue by this step
    partial: list[bool]  # per entry: a prompt this step leaves mid-prefill (a chunk, more to come)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.entries)

    @property
    def reqs(self) -> list[Request]:
        return [r for r, _, _ in self.entries]

    def n_of(self, req: Request) -> int | None:
        return next((n for r, n, _ in self.entries if r is req), None)

    def sampled(self, req: Request) -> bool:
        return any(s for r, _, s in self.entries if r is req)


def fake_step(sched: Scheduler, max_model_len: int, token=lambda req: 7) -> StepRecord:
    """One engine step without a model; finishes requests that reach their max_tokens or the context."""
    running_before = {id(r) for r in sched.running}
    batch = sched.schedule()
    samples = batch.samples()  # NOTE: before postprocess, which advances num_computed_tokens
    rec = StepRecord(list(zip(batch.reqs, batch.num_new_tokens, samples)), [r.is_prefilling for r in batch.reqs],
                     [id(r) not in running_before for r in batch.reqs],
                     [r.num_computed_tokens + n < r.num_tokens for r, n in zip(batch.reqs, batch.num_new_tokens)])
    sched.postprocess(batch)
    for req, sampled in zip(batch.reqs, samples):
        if sampled:
            req.token_ids.append(token(req))
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
                sched.finish(req, "length")
    return rec


def make(max_model_len: int = 1024, num_blocks: int = 256, block_size: int = 16, **cfg_kw) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **cfg_kw)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, cfg.enable_prefix_caching), max_model_len)


_bases = iter(range(1, 10**9))


def req(prompt_len: int, max_tokens: int, rid: str | None = None) -> Request:
    """A request with a distinct prompt, so no prefix is shared."""
    base = next(_bases) * 100_000
    prompt = [base + i for i in range(prompt_len)]
    return Request(rid or f"r{base}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def run_until_done(sched: Scheduler, max_model_len: int, max_steps: int = 10_000, check=None) -> list[StepRecord]:
    recs = []
    while sched.has_unfinished():
        assert len(recs) < max_steps, f"no completion after {max_steps} steps: {sched.running} {list(sched.waiting)}"
        recs.append(fake_step(sched, max_model_len))
        if check:
            check(recs[-1])
    return recs


# -- budget and max_num_seqs ---------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "static"])
def test_budget_and_max_num_seqs_never_exceeded(policy):
    budget, max_seqs, max_len = 64, 5, 256
    sched = make(max_model_len=max_len, num_blocks=64, scheduling=policy, max_num_batched_tokens=budget,
                 max_num_seqs=max_seqs, long_prefill_token_threshold=48, max_num_partial_prefills=3)
    shapes = [(1, 3), (200, 5), (40, 9), (64, 2), (3, 30), (130, 4), (17, 17), (90, 1), (5, 5), (255, 1)]
    reqs = [req(n, m) for n, m in shapes]
    for r in reqs:
        sched.add(r)
    # NOTE: the baselines never chunk, so their budget is raised to fit one whole prompt (scheduler docstring)
    step_budget = budget if policy == "mixed" else sched.whole_prompt_budget

    def check(rec: StepRecord) -> None:
        assert 0 < rec.num_tokens <= step_budget
        assert len(rec.entries) <= max_seqs
        assert len(sched.running) <= max_seqs
        assert len({id(r) for r in rec.reqs}) == len(rec.entries), "a request scheduled twice in one step"
        if not any(rec.admitted):
            assert rec.num_tokens <= budget  # steps without admissions respect the real budget in every policy
        sched.bm.check_integrity(sched.running)

    recs = run_until_done(sched, max_len, check=check)
    assert all(r.status is Status.FINISHED and r.num_output_tokens == r.max_tokens for r in reqs)
    if policy == "mixed":
        assert max(rec.num_tokens for rec in recs) == budget, "the budget was never filled: the test is too easy"
        assert any(n > 1 and n < r.num_prompt_tokens for rec in recs for r, n, _ in rec.entries), "nothing chunked"


# -- mixed: decodes keep flowing while a long prompt prefills -----------------------------


def test_mixed_schedules_every_decode_while_4k_prompt_prefills():
    max_len = 8192
    sched = make(max_model_len=max_len, num_blocks=max_len // 16 + 64, scheduling="mixed",
                 max_num_batched_tokens=256, max_num_seqs=32, max_num_partial_prefills=8)
    decoders = [req(10 + i, 1000) for i in range(8)]
    for r in decoders:
        sched.add(r)
    fake_step(sched, max_len)  # all 8 prompts fit in one step
    assert all(not r.is_prefilling and r.status is Status.RUNNING for r in decoders)

    big = req(4096, 4)
    sched.add(big)
    steps = 0
    while big.num_computed_tokens < big.num_prompt_tokens:
        decoding = [r for r in sched.running if not r.is_prefilling]
        rec = fake_step(sched, max_len)
        steps += 1
        for r in decoding:
            assert rec.n_of(r) == 1 and rec.sampled(r), f"step {steps}: running decode {r} was not scheduled"
        assert rec.n_of(big) is not None, f"step {steps}: the long prompt made no progress"
        assert rec.num_tokens <= 256
        assert steps < 100
    assert set(decoding) >= set(decoders)
    assert steps == -(-4096 // (256 - 8))  # the prompt got exactly the budget the decodes left
    assert all(r.num_output_tokens == steps + 1 for r in decoders)  # a token every single step


# -- prefill_first: a new prompt pauses the decodes -------------------------------------


def test_prefill_first_pauses_decodes_for_a_whole_prefill():
    max_len = 512
    sched = make(max_model_len=max_len, scheduling="prefill_first", max_num_batched_tokens=32, max_num_seqs=8)
    decoders = [req(5, 50) for _ in range(3)]
    for r in decoders:
        sched.add(r)
    fake_step(sched, max_len)
    rec = fake_step(sched, max_len)
    assert set(rec.reqs) == set(decoders) and all(n == 1 for _, n, _ in rec.entries)

    newcomer = req(300, 5)  # longer than the budget: still prefilled whole, in a step of its own
    sched.add(newcomer)
    rec = fake_step(sched, max_len)
    assert rec.reqs == [newcomer] and rec.n_of(newcomer) == 300 and rec.sampled(newcomer)
    rec = fake_step(sched, max_len)  # decodes resume, the newcomer's included
    assert set(rec.reqs) == set(decoders) | {newcomer} and all(n == 1 for _, n, _ in rec.entries)


# -- static: arrivals wait for the whole batch ----------------------------------------------


def test_static_admits_nothing_while_a_batch_runs():
    max_len = 512
    sched = make(max_model_len=max_len, scheduling="static", max_num_batched_tokens=64, max_num_seqs=8)
    first = [req(20, m) for m in (3, 6, 10)]
    for r in first:
        sched.add(r)
    rec = fake_step(sched, max_len)
    assert set(rec.reqs) == set(first) and all(rec.n_of(r) == 20 for r in first)  # prefilled whole

    late = [req(8, 4) for _ in range(2)]
    for r in late:
        sched.add(r)
    steps = 0
    while any(r.status is not Status.FINISHED for r in first):
        live = [r for r in first if r.status is Status.RUNNING]
        rec = fake_step(sched, max_len)
        steps += 1
        assert not set(rec.reqs) & set(late), f"step {steps}: an arrival joined a running static batch"
        assert set(rec.reqs) == set(live)
        assert all(r.status is Status.WAITING for r in late)
    assert steps == 9  # the longest member (10 tokens) decodes 9 more after its prefill
    rec = fake_step(sched, max_len)
    assert set(rec.reqs) == set(late)  # the next batch forms once nothing runs


# -- partial-prefill cap ---------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_partial_prefill_cap(cap):
    max_len = 512
    sched = make(max_model_len=max_len, scheduling="mixed", max_num_batched_tokens=96, max_num_seqs=16,
                 long_prefill_token_threshold=16, max_num_partial_prefills=cap)
    reqs = [req(100, 3) for _ in range(6)] + [req(1, 3) for _ in range(2)]
    for r in reqs:
        sched.add(r)
    peak = 0

    def check(rec: StepRecord) -> None:
        nonlocal peak
        left = sum(rec.partial)
        mid = sum(1 for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens)
        assert left <= cap and mid <= cap, f"{left} left mid-prefill by the step, {mid} mid-prefill"
        assert all(n <= 16 for _, n, _ in rec.entries)
        peak = max(peak, left)

    run_until_done(sched, max_len, check=check)
    assert peak == cap  # the budget (96 = 6 x 16) would allow more: the cap is what holds it
    assert all(r.num_output_tokens == 3 for r in reqs)


def test_prompts_a_step_finishes_are_not_held_by_the_partial_cap():
    """The cap bounds prompts left mid-prefill, not prompts per step: a burst of short prompts is admitted in one
    step (the budget permitting), not `max_num_partial_prefills` a step. (It was 4 a step: 64 steps to start 256
    chats.)"""
    sched = make(max_model_len=256, scheduling="mixed", max_num_batched_tokens=2048, max_num_seqs=256,
                 long_prefill_token_threshold=8, max_num_partial_prefills=4)
    reqs = [req(8, 3) for _ in range(100)] + [req(100, 3) for _ in range(8)]
    for r in reqs:
        sched.add(r)
    rec = fake_step(sched, 256)
    assert sum(rec.admitted) == 100 + 4 and sum(rec.partial) == 4  # 100 whole prompts, then four chunks of 8
    assert rec.num_tokens == 104 * 8 and all(rec.sampled(r) for r in reqs[:100])


def test_a_burst_sharing_a_prefix_computes_it_once():
    """Prompts that arrive together with a shared prefix (a system prompt): the first computes it; the others, whose
    next block that step computes, wait one step and find it cached, instead of each computing it beside it. A
    prompt behind them that shares nothing is not held up."""
    sched = make(max_model_len=512, scheduling="mixed", max_num_batched_tokens=2048, max_num_seqs=64)
    shared = list(range(1000, 1064))  # four full blocks
    reqs = [Request(f"s{i}", shared + [2000 + i, 3000 + i], SamplingParams(max_tokens=2), 2) for i in range(8)]
    other = req(40, 2)
    for r in [*reqs, other]:
        sched.add(r)
    rec = fake_step(sched, 512)
    assert rec.reqs == [reqs[0], other] and rec.num_tokens == 66 + 40
    rec = fake_step(sched, 512)
    assert rec.reqs == [reqs[0], other, *reqs[1:]]
    assert all(r.num_cached_tokens == 64 and rec.n_of(r) == 2 for r in reqs[1:])


def test_identical_block_aligned_prompts_are_not_held_a_step_each():
    """A prompt whose every block is cached still computes its last one (its last token's logits): that block is
    cached already, so an identical prompt behind it does not wait for it (they went one a step)."""
    sched = make(max_model_len=512, scheduling="mixed", max_num_batched_tokens=2048, max_num_seqs=64)
    prompt = list(range(1000, 1064))  # four full blocks
    reqs = [Request(f"same{i}", list(prompt), SamplingParams(max_tokens=2), 2) for i in range(8)]
    for r in reqs:
        sched.add(r)
    first = fake_step(sched, 512)
    assert first.reqs == [reqs[0]]  # the others' blocks are this step's
    rec = fake_step(sched, 512)
    assert rec.reqs == reqs and all(rec.n_of(r) == 16 for r in reqs[1:])  # 48 tokens cached, the last block again


def test_a_prompt_waiting_on_a_long_shared_prefill_holds_back_no_one():
    """B shares a long prompt with A, whose prefill is chunked over many steps: B waits for A's blocks (it would only
    compute them again), and C, queued behind B and sharing nothing, starts at once."""
    sched = make(max_model_len=4096, num_blocks=512, scheduling="mixed", max_num_batched_tokens=512,
                 long_prefill_token_threshold=128)
    shared = list(range(10_000, 12_000))
    a, b = (Request(name, shared + [20_000 + i], SamplingParams(max_tokens=2), 2) for i, name in enumerate("ab"))
    c = req(20, 2)
    for r in (a, b, c):
        sched.add(r)
    rec = fake_step(sched, 4096)
    assert rec.reqs == [a, c] and b.status is Status.WAITING
    while a.is_prefilling:
        rec = fake_step(sched, 4096)
        assert b not in rec.reqs or not a.is_prefilling
    rec = fake_step(sched, 4096)
    assert b in rec.reqs and b.num_cached_tokens >= 1984  # A's blocks, all but the last partial one


# -- fairness: a short prompt behind a 10k-token prompt ----------------------------------


def _steps_to_first_token(threshold: int | None, partial: int) -> int:
    max_len = 12_288
    sched = make(max_model_len=max_len, num_blocks=max_len // 16 + 16, scheduling="mixed",
                 max_num_batched_tokens=512, long_prefill_token_threshold=threshold, max_num_partial_prefills=partial)
    long = req(10_000, 2)
    sched.add(long)
    fake_step(sched, max_len)
    fake_step(sched, max_len)
    short = req(20, 2)
    sched.add(short)
    for step in range(1, 200):
        if fake_step(sched, max_len).sampled(short):
            assert long.num_computed_tokens < long.num_prompt_tokens or threshold is None
            return step
    raise AssertionError("the short prompt never got a token")


def test_short_prompt_behind_10k_prompt_gets_its_first_token_quickly():
    assert _steps_to_first_token(threshold=256, partial=2) == 1  # admitted into the budget the chunk leaves
    # control: with no per-prompt threshold the long prompt takes the whole budget, so the bound above is real
    assert _steps_to_first_token(threshold=None, partial=2) > 10


# -- preemption -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "static"])
def test_the_oldest_request_preempts_the_newest_not_its_neighbour(policy):
    max_len = 32
    sched = make(max_model_len=max_len, num_blocks=8, block_size=4, scheduling=policy, max_num_batched_tokens=64,
                 max_num_seqs=4)
    r0 = req(8, 4, rid="r0")  # two full blocks: its first decode needs a third
    others = [req(6, 3, rid=f"r{i}") for i in (1, 2, 3)]  # two blocks each, room left in the second
    late = req(6, 2, rid="late")  # max_num_seqs: waits
    for r in [r0, *others, late]:
        sched.add(r)
    fake_step(sched, max_len)
    assert list(sched.running) == [r0, *others] and sched.bm.num_free_blocks == 0
    rec = fake_step(sched, max_len)
    assert sched.num_preemptions == 1
    assert list(sched.running) == [r0, *others[:2]] and set(rec.reqs) == {r0, *others[:2]}
    assert list(sched.waiting) == [others[2], late], "the preempted request goes back to the front of the queue"
    run_until_done(sched, max_len)
    assert all(r.num_output_tokens == r.max_tokens for r in [r0, *others, late])


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "static"])
def test_preemption_requeues_most_recent_at_front_and_it_completes(policy):
    block_size, num_blocks = 4, 10
    max_len = num_blocks * block_size
    sched = make(max_model_len=max_len, num_blocks=num_blocks, block_size=block_size, scheduling=policy,
                 max_num_batched_tokens=64, max_num_seqs=8)
    reqs = [req(8, 12, rid=f"r{i}") for i in range(3)]  # 3 x 5 blocks needed at the end, 10 exist
    tail = req(6, 3, rid="tail")
    for r in [*reqs, tail]:
        sched.add(r)
    admitted: list[Request] = []  # first-admission order
    seen_preemption = False
    for _ in range(500):
        if not sched.has_unfinished():
            break
        running_before = list(sched.running)
        before = sched.num_preemptions
        fake_step(sched, max_len)
        admitted += [r for r in sched.running if r not in admitted]
        if sched.num_preemptions > before:
            seen_preemption = True
            victims = [r for r in running_before if r.status is Status.WAITING]
            k = sched.num_preemptions - before
            assert len(victims) == k
            survivors = [r for r in running_before if r.status is not Status.WAITING]
            assert victims == running_before[len(running_before) - k :], "a request other than the newest was preempted"
            assert list(sched.waiting)[:k] == victims, "preempted requests must wait at the front"
            assert all(v.block_table == [] and v.num_computed_tokens == 0 for v in victims)
            assert all(r.status in (Status.RUNNING, Status.FINISHED) for r in survivors)
        sched.bm.check_integrity(sched.running)
        assert all(not r.block_table for r in sched.waiting)
    assert seen_preemption, "the pool was meant to run out"
    assert not sched.has_unfinished()
    for r in [*reqs, tail]:
        assert r.status is Status.FINISHED and r.finish_reason == "length"
        assert r.num_output_tokens == r.max_tokens
        assert r.token_ids[r.num_prompt_tokens :] == [7] * r.max_tokens
    assert sched.bm.num_free_blocks == num_blocks


# -- the queues: FIFO order, O(1) removal ---------------------------------------------------


def test_request_queue_keeps_order_and_removes_from_anywhere():
    rs = [req(1, 1, rid=f"q{i}") for i in range(5)]
    q = RequestQueue()
    for r in rs[1:]:
        q.append(r)
    q.appendleft(rs[0])
    assert list(q) == rs and list(reversed(q)) == rs[::-1] and len(q) == 5 and q.first() is rs[0]
    q.remove(rs[2])
    assert q.popleft() is rs[0] and list(q) == [rs[1], rs[3], rs[4]]
    q.appendleft(rs[0])  # a preempted request goes back to the front
    assert list(q) == [rs[0], rs[1], rs[3], rs[4]] and rs[2] not in list(q)
    with pytest.raises(KeyError):
        q.remove(rs[2])


def test_finish_and_preemption_never_walk_the_queues(monkeypatch):
    sched = make(max_model_len=64, num_blocks=1024, block_size=4, max_num_seqs=256, max_num_batched_tokens=4096,
                 max_num_partial_prefills=256)
    reqs = [req(4, 8) for _ in range(300)]
    for r in reqs:
        sched.add(r)
    fake_step(sched, 64)  # 256 run, 44 wait
    assert len(sched.running) == 256 and len(sched.waiting) == 44

    def walk(self):
        raise AssertionError("removal must be O(1): it walked the queue")

    monkeypatch.setattr(RequestQueue, "__iter__", walk)
    monkeypatch.setattr(RequestQueue, "__reversed__", walk)
    sched.finish(reqs[100], "abort")  # from the middle of running
    sched.finish(reqs[270], "abort")  # from the middle of waiting
    sched._preempt(reqs[200])
    monkeypatch.undo()
    assert reqs[100] not in list(sched.running) and reqs[270] not in list(sched.waiting)
    assert list(sched.waiting)[0] is reqs[200] and len(sched.running) == 254 and len(sched.waiting) == 44
    sched.bm.check_integrity(sched.running)
