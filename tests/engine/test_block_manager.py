"""BlockManager: the O(1) LRU free queue, chained prefix hashes, ref counts, the per-request bookkeeping it alone
writes (computed / cached / committed counts), pinning, integrity checks, and a property test driving a real
Scheduler + BlockManager through random add/step/abort/stop sequences."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from engine.block_manager import Block, BlockManager, FreeBlockQueue
from engine.config import EngineConfig
from engine.request import Request, SamplingParams, Status
from engine.scheduler import Scheduler
from tests.engine.test_scheduler import fake_step

BS = 4


def compute(bm: BlockManager, rid: str, tokens: list[int]) -> tuple[Request, int]:
    """Admits `tokens` as the scheduler would (prefix lookup, allocate, compute all, commit); returns the hit."""
    req = Request(rid, tokens, SamplingParams(), 1)
    cached = bm.match_prefix(req)
    assert bm.allocate(req, req.num_tokens - len(cached) * bm.block_size, cached)
    bm.commit(req, req.num_tokens - req.num_computed_tokens)
    assert req.num_computed_tokens == req.num_tokens
    return req, req.num_cached_tokens


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# -- the free queue ------------------------------------------------------------------------


def test_free_queue_append_popleft_and_remove_from_the_middle():
    blocks = [Block(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert [b.id for b in q] == [0, 1, 2, 3, 4, 5] and len(q) == 6
    q.remove(blocks[3])
    q.remove(blocks[0])
    q.remove(blocks[5])
    assert [b.id for b in q] == [1, 2, 4] and len(q) == 3
    assert blocks[3].prev is None and blocks[3].next is None
    q.append(blocks[3])
    q.append(blocks[0])
    assert [b.id for b in q] == [1, 2, 4, 3, 0]
    assert [q.popleft().id for _ in range(5)] == [1, 2, 4, 3, 0] and len(q) == 0
    with pytest.raises(AssertionError):
        q.popleft()
    with pytest.raises(AssertionError):
        q.remove(blocks[2])  # not in the queue


def test_free_queue_remove_never_walks_the_list(monkeypatch):
    blocks = [Block(i) for i in range(10_000)]
    q = FreeBlockQueue(blocks)

    def walk(self):
        raise AssertionError("removal must be O(1): it walked the queue")

    monkeypatch.setattr(FreeBlockQueue, "__iter__", walk)
    for i in range(5000, 5100):
        q.remove(blocks[i])
    assert len(q) == 9900 and blocks[4999].next is blocks[5100] and blocks[5100].prev is blocks[4999]
    monkeypatch.undo()
    assert [b.id for b in q][4998:5001] == [4998, 4999, 5100]


def test_revive_takes_a_cached_block_out_of_the_middle_of_the_free_queue():
    bm = BlockManager(8, BS)
    a, _ = compute(bm, "a", toks(100, 9))  # blocks 0,1 full + block 2 partial
    b, _ = compute(bm, "b", toks(200, 9))  # blocks 3,4 + 5
    a_blocks = list(a.block_table)
    bm.free(a)
    bm.free(b)
    order = [blk.id for blk in bm.free_queue]
    c, hit = compute(bm, "c", toks(100, 8) + [999])
    assert hit == 8 and c.block_table[:2] == a_blocks[:2]
    assert [blk.id for blk in bm.free_queue] == [i for i in order if i not in c.block_table]
    bm.check_integrity([c])


# -- LRU eviction ----------------------------------------------------------------------------


def test_lru_eviction_order():
    bm = BlockManager(4, BS)
    a, _ = compute(bm, "a", toks(100, 8))  # blocks 0, 1
    b, _ = compute(bm, "b", toks(200, 8))  # blocks 2, 3
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(a)  # freed first: evicted first; a request's tail goes before its head
    bm.free(b)
    assert [blk.id for blk in bm.free_queue] == [1, 0, 3, 2]

    c, _ = compute(bm, "c", toks(300, 4))  # one fresh block: a's tail (block 1) is the LRU one
    assert c.block_table == [1]
    assert bm.blocks[1].hash == hash((0, tuple(toks(300, 4))))  # re-hashed for its new tokens
    # a's head block survived, its tail did not; b is intact
    a2, hit_a = compute(bm, "a2", toks(100, 8) + [1])
    assert hit_a == 4
    bm.check_integrity([c, a2])


def test_free_blocks_stay_findable_until_evicted():
    bm = BlockManager(6, BS)
    a, _ = compute(bm, "a", toks(100, 12))
    bm.free(a)
    assert bm.num_free_blocks == 6
    for i in range(3):  # the never-used blocks go first, then x0's (freed after a's)
        x, _ = compute(bm, f"x{i}", toks(1000 * (i + 1), 4))
        assert x.block_table == [3 + i]
        bm.free(x)
    a2, hit = compute(bm, "a2", toks(100, 12) + [5])
    assert hit == 12 and a2.block_table == [0, 1, 2, 3]


# -- hash chaining -----------------------------------------------------------------------------


def test_same_block_tokens_under_different_parents_do_not_match():
    bm = BlockManager(16, BS)
    x, y, z = toks(10, 4), toks(20, 4), toks(30, 4)
    live = [compute(bm, "xy", x + y + [1])[0]]
    r, hit = compute(bm, "zy", z + y + [1])
    assert hit == 0  # y's block is cached, but under parent x, not z
    live.append(r)
    r, hit = compute(bm, "xy2", x + y + [2])
    assert hit == 8
    live.append(r)
    r, hit = compute(bm, "y", y + [3])
    assert hit == 0  # y as a first block has no parent: another chain again
    live.append(r)
    r, hit = compute(bm, "xz", x + z + [4])
    assert hit == 4  # the shared parent still matches
    live.append(r)
    bm.check_integrity(live)


def test_lookup_checks_the_tokens_not_just_the_hash():
    bm = BlockManager(8, BS)
    a, _ = compute(bm, "a", toks(10, 8) + [0])
    blk = bm.blocks[a.block_table[0]]
    # forge a collision: the cached block's key no longer matches what its hash claims
    blk.key = (0, tuple(toks(50, 4)))
    _, hit = compute(bm, "b", toks(10, 8) + [0])
    assert hit == 0


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, _ = compute(bm, "a", toks(10, 9))
    bm.free(a)
    _, hit = compute(bm, "b", toks(10, 9))
    assert hit == 0 and not bm.cached


# -- ref counts ---------------------------------------------------------------------------------


def test_ref_counts_on_shared_prefixes():
    bm = BlockManager(16, BS)
    shared = toks(10, 8)
    a, _ = compute(bm, "a", shared + [1, 2, 3])
    b, hit_b = compute(bm, "b", shared + [4, 5])
    c, hit_c = compute(bm, "c", shared[:4] + [6, 7, 8, 9, 10])
    assert hit_b == 8 and hit_c == 4
    s0, s1 = a.block_table[:2]
    assert b.block_table[:2] == [s0, s1] and c.block_table[0] == s0 and c.block_table[1] != s1
    assert bm.blocks[s0].ref_count == 3 and bm.blocks[s1].ref_count == 2
    assert bm.blocks[a.block_table[2]].ref_count == 1
    bm.check_integrity([a, b, c])
    used = len({*a.block_table, *b.block_table, *c.block_table})
    assert bm.num_free_blocks == 16 - used

    bm.free(a)
    assert bm.blocks[s0].ref_count == 2 and bm.blocks[s1].ref_count == 1
    assert bm.blocks[s0] not in list(bm.free_queue)
    bm.check_integrity([b, c])
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 16 and all(blk.ref_count == 0 for blk in bm.blocks)
    bm.check_integrity()
    with pytest.raises(AssertionError):
        b.block_table = [s0]
        bm.free(b)  # double free


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4, BS)
    a, _ = compute(bm, "a", toks(10, 8))
    big = Request("big", toks(100, 12), SamplingParams(), 1)
    assert not bm.can_allocate(big, 12)
    assert not bm.allocate(big, 12)
    assert big.block_table == [] and bm.num_free_blocks == 2
    bm.check_integrity([a])
    # reviving a cached block also costs a free block
    bm.free(a)
    again = Request("again", toks(10, 8) + toks(100, 12), SamplingParams(), 1)
    cached = bm.match_prefix(again)
    assert len(cached) == 2
    assert not bm.can_allocate(again, 12, cached)  # 2 revived + 3 fresh > 4
    assert not bm.allocate(again, 12, cached)
    assert (again.block_table, again.num_computed_tokens, again.admitted) == ([], 0, False)  # nothing to roll back
    assert bm.allocate(again, 8, cached)  # 2 revived + 2 fresh = 4
    assert bm.num_free_blocks == 0
    bm.check_integrity([again])


# -- per-request bookkeeping: allocate sets it, commit moves it on, free resets it ------------------


def test_admission_counts_cache_hits_as_computed_and_committed():
    bm = BlockManager(16, BS)
    warm, _ = compute(bm, "warm", toks(10, 12) + [1])
    req = Request("r", toks(10, 12) + [2, 3], SamplingParams(), 1)
    cached = bm.match_prefix(req)
    assert len(cached) == 3
    assert bm.allocate(req, 2, cached)
    assert (req.num_computed_tokens, req.num_committed_blocks, req.num_cached_tokens) == (12, 3, 12)
    assert req.block_table[:3] == [b.id for b in cached.blocks] and len(req.block_table) == 4
    bm.commit(req, 2)
    assert (req.num_computed_tokens, req.num_committed_blocks) == (14, 3)  # the 4th block is not full
    bm.check_integrity([warm, req])


def test_commit_publishes_each_full_block_once_and_moves_the_count_on():
    bm = BlockManager(16, BS)
    req = Request("r", toks(10, 10), SamplingParams(), 1)
    assert bm.allocate(req, 3)  # a 3-token chunk: nothing full yet
    bm.commit(req, 3)
    assert (req.num_computed_tokens, req.num_committed_blocks, len(bm.cached)) == (3, 0, 0)
    assert bm.allocate(req, 7)
    bm.commit(req, 7)
    assert (req.num_computed_tokens, req.num_committed_blocks, len(bm.cached)) == (10, 2, 2)
    assert [bm.cached[h].id for h in req.block_hashes] == req.block_table[:2]
    req.token_ids.append(5)  # a decode: the block is still not full
    assert bm.allocate(req, 1)
    bm.commit(req, 1)
    assert (req.num_committed_blocks, len(bm.cached)) == (2, 2)
    bm.check_integrity([req])
    with pytest.raises(AssertionError, match="past its blocks"):
        bm.commit(req, 2)


def test_free_resets_the_counts_and_readmission_counts_the_prompt_once():
    bm = BlockManager(16, BS)
    req = Request("r", toks(10, 9), SamplingParams(), 1)
    assert bm.allocate(req, 9) and bm.prefix_cache_queries == 9 and bm.prefix_cache_hits == 0
    bm.commit(req, 9)
    req.token_ids.append(7)
    bm.free(req)  # preempted
    assert (req.block_table, req.num_computed_tokens, req.num_committed_blocks) == ([], 0, 0)
    cached = bm.match_prefix(req)  # its own blocks are still cached
    assert len(cached) == 2 and bm.allocate(req, 2, cached)
    assert (req.num_computed_tokens, req.num_committed_blocks) == (8, 2)
    assert req.num_cached_tokens == 0, "num_cached_tokens is the first admission's hit"
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (9, 0), "a readmitted prompt is counted once"
    bm.check_integrity([req])


def test_prefix_hits_are_taken_on_admission_only():
    bm = BlockManager(16, BS)
    compute(bm, "warm", toks(10, 8) + [1])
    req = Request("r", toks(10, 8) + [2], SamplingParams(), 1)
    cached = bm.match_prefix(req)
    assert bm.allocate(req, 1, cached)
    with pytest.raises(AssertionError, match="admission"):
        bm.allocate(req, 1, cached)


# -- a fully cached prompt still computes its last token --------------------------------------


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 12, 16, 17])
def test_match_prefix_never_covers_the_last_token(n):
    bm = BlockManager(32, BS)
    compute(bm, "warm", toks(10, n) + toks(500, 8))  # every block of the prompt below is cached
    req = Request("r", toks(10, n), SamplingParams(), 1)
    hit = len(bm.match_prefix(req)) * BS
    assert hit < n, "the last prompt token must be computed to get its logits"
    assert hit == (n - 1) // BS * BS  # ...but every full block before it is served from the cache


# -- pinning -----------------------------------------------------------------------------------


def test_pinned_blocks_are_never_evicted():
    bm = BlockManager(8, BS)
    system = toks(10, 10)  # 2 full blocks + 2 tokens
    a, _ = compute(bm, "a", system + [1])
    pinned_ids = a.block_table[:2]
    bm.free(a)
    assert bm.pin(system) == 8
    assert bm.num_free_blocks == 6
    bm.check_integrity()
    for i in range(20):  # churn through every unpinned block many times
        r, _ = compute(bm, f"x{i}", toks(1000 * (i + 1), 4 * (1 + i % 6)))
        assert not set(r.block_table) & set(pinned_ids)
        bm.check_integrity([r])
        bm.free(r)
    big = Request("big", toks(5000, 28), SamplingParams(), 1)
    assert not bm.allocate(big, 28)  # 7 blocks: more than the 6 unpinned ones
    r, hit = compute(bm, "b", system + [2, 3])
    assert hit == 8 and r.block_table[:2] == pinned_ids
    assert all(bm.blocks[i].ref_count == 2 for i in pinned_ids)
    bm.check_integrity([r])
    bm.free(r)
    assert bm.num_free_blocks == 6  # still held by the pin


def test_pin_takes_token_ids_not_a_request():
    bm = BlockManager(8, BS)
    a, _ = compute(bm, "a", toks(10, 9))
    full = a.block_table[:2]
    bm.free(a)
    assert bm.pin(toks(10, 9)) == 8  # two full blocks; the partial third is never pinned
    assert [b.id for b in bm.pinned] == full and bm.num_free_blocks == 6
    assert bm.prefix_cache_queries == 9, "pinning is not a request: no cache stats"
    bm.check_integrity()


def test_pin_of_uncached_tokens_pins_nothing():
    bm = BlockManager(8, BS)
    assert bm.pin(toks(10, 8)) == 0
    assert bm.num_free_blocks == 8 and not bm.pinned


# -- integrity checks catch corruption --------------------------------------------------------


def test_check_integrity_catches_a_corrupted_ref_count():
    bm = BlockManager(8, BS)
    a, _ = compute(bm, "a", toks(10, 9))
    bm.check_integrity([a])
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_integrity([a])
    bm.blocks[a.block_table[0]].ref_count -= 1
    bm.check_integrity([a])
    with pytest.raises(AssertionError):
        bm.check_integrity([])  # a's blocks have holders the check was not told about


def test_check_integrity_catches_free_queue_and_cache_corruption():
    bm = BlockManager(8, BS)
    a, _ = compute(bm, "a", toks(10, 9))
    bm.free(a)
    bm.free_queue.remove(bm.blocks[0])  # free (ref 0) but no longer queued
    with pytest.raises(AssertionError, match="free-queue"):
        bm.check_integrity()

    bm = BlockManager(8, BS)
    a, _ = compute(bm, "a", toks(10, 9))
    bm.cached.pop(bm.blocks[a.block_table[0]].hash)
    with pytest.raises(AssertionError, match="findable"):
        bm.check_integrity([a])


# -- property test: a real Scheduler + BlockManager under random traffic -----------------------

_add = st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 24))
_step = st.tuples(st.just("step"), st.integers(1, 4))
ops_strategy = st.lists(  # weighted towards traffic, so the small pool runs dry
    st.one_of(_add, _add, _add, _step, _step, st.tuples(st.sampled_from(["abort", "stop"]), st.integers(0, 1000))),
    min_size=6,
    max_size=40,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["mixed", "prefill_first", "static"]),
    block_size=st.sampled_from([2, 4]),
    num_blocks=st.integers(5, 16),
    max_num_seqs=st.integers(2, 6),
    budget=st.integers(2, 48),
    threshold=st.one_of(st.none(), st.integers(1, 16)),
    partial=st.integers(1, 3),
    prefix_caching=st.booleans(),
    eviction=st.sampled_from(["lru", "slru"]),
    host_blocks=st.sampled_from([0, 1, 3]),
    ops=ops_strategy,
    data=st.data(),
)
def test_random_traffic_keeps_the_pool_consistent(
    policy, block_size, num_blocks, max_num_seqs, budget, threshold, partial, prefix_caching, eviction, host_blocks,
    ops, data
):
    max_len = num_blocks * block_size  # the engine's rule: one request always fits in the pool
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, scheduling=policy, long_prefill_token_threshold=threshold,
                       max_num_partial_prefills=partial, enable_prefix_caching=prefix_caching)
    bm = BlockManager(num_blocks, block_size, prefix_caching, host_blocks, eviction)
    sched = Scheduler(cfg, bm, max_len)
    step_budget = budget if policy == "mixed" else sched.whole_prompt_budget
    prefixes = [[], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 16]
    reqs: list[Request] = []
    aborted: set[str] = set()

    def token(req: Request) -> int:
        return (req.num_tokens * 3 + len(req.request_id)) % 4  # few distinct tokens: outputs share blocks too

    def step() -> None:
        rec = fake_step(sched, max_len, token)
        offloads, loads = bm.take_copies()  # each slot and block written at most once a step
        assert len({s for _, s in offloads}) == len(offloads) and len({b for _, b in loads}) == len(loads)
        assert rec.num_tokens <= step_budget and len(rec.entries) <= max_num_seqs
        assert all(n >= 1 for _, n, _ in rec.entries)
        if policy == "mixed":
            assert sum(rec.partial) <= partial
        if not any(rec.admitted):
            assert rec.num_tokens <= budget
        check()

    def check() -> None:
        bm.check_integrity(sched.running)
        assert len(sched.running) <= max_num_seqs
        assert all(not r.block_table and r.status is Status.WAITING for r in sched.waiting)
        assert all(r.status is Status.RUNNING and r.num_computed_tokens < r.num_tokens for r in sched.running)
        live = [*sched.running, *sched.waiting]
        assert len({id(r) for r in live}) == len(live)
        assert {id(r) for r in live} == {id(r) for r in reqs if r.status is not Status.FINISHED}, "a request was lost"

    for op in ops:
        if op[0] == "add":
            _, prefix, extra, max_tokens = op
            prompt = prefixes[prefix] + data.draw(st.lists(st.integers(0, 9), min_size=extra, max_size=extra))
            prompt = prompt[: max_len // 2]  # room to grow: requests outgrow the pool together
            r = Request(f"r{len(reqs)}", prompt, SamplingParams(), min(max_tokens, max_len - len(prompt)))
            reqs.append(r)
            sched.add(r)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        else:
            live = [r for r in reqs if r.status is not Status.FINISHED]
            if op[0] == "stop":  # a stop string / stop token: only a request that sampled can stop
                live = [r for r in live if r.status is Status.RUNNING and r.num_output_tokens > 0]
            if live:
                victim = live[op[1] % len(live)]
                if op[0] == "abort":
                    aborted.add(victim.request_id)
                sched.finish(victim, op[0])
                check()

    for _ in range(5000):
        if not sched.has_unfinished():
            break
        step()
    target(float(sched.num_preemptions), label="preemptions")
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {bm.prefix_cache_hits > 0}")
    assert not sched.has_unfinished(), f"no progress: running={sched.running} waiting={list(sched.waiting)}"
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_integrity()
    for r in reqs:
        assert r.status is Status.FINISHED
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens
        else:
            assert r.finish_reason in ("abort", "stop")
            assert r.num_output_tokens <= r.max_tokens


def test_slru_keeps_a_hit_prefix_through_a_scan_that_lru_evicts() -> None:
    """A prefix hit once is protected: one-off prompts (a scan) take the other free blocks first. Plain LRU
    evicts the oldest freed block, the hot prefix among them."""
    survivors = {}
    for policy in ("lru", "slru"):
        bm = BlockManager(8, BS, eviction=policy)
        hot = toks(0, 9)  # 2 full blocks, cached
        bm.free(compute(bm, "h1", hot)[0])
        bm.free(compute(bm, "h2", hot)[0])  # a hit: slru protects its blocks
        for i in range(3):  # one-off prompts of 4 blocks, each needing most of the pool
            bm.free(compute(bm, f"scan{i}", toks(100 + 20 * i, 16))[0])
        req, survivors[policy] = compute(bm, "h3", hot)
        bm.check_integrity([req])
    assert survivors == {"lru": 0, "slru": 8}


def test_slru_protected_queue_is_capped_and_demotes_its_oldest() -> None:
    bm = BlockManager(8, BS, eviction="slru")  # cap: 4 protected blocks
    prompts = [toks(40 * i, 5) for i in range(6)]  # one full block each
    for i, p in enumerate(prompts):
        bm.free(compute(bm, f"a{i}", p)[0])
        bm.free(compute(bm, f"b{i}", p)[0])  # hit: protected
    assert len(bm.protected) == bm.protected_cap == 4
    assert [b.hash for b in bm.protected] == [bm.hash_blocks(Request("x", p, SamplingParams(), 1))[0]
                                                for p in prompts[2:]]  # the two oldest went back on probation
    bm.check_integrity()
