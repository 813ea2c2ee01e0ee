"""Paged KV block pool with a prefix cache; the one writer of each request's KV bookkeeping.

Invariants (checked by `check_integrity`): a block's `ref_count` equals the number of live block
tables (plus pins) holding it; exactly the blocks with `ref_count == 0` sit in the free queue, in
LRU order; a hashed block is findable under its hash until it is handed out again (evicted).

With a host tier (`num_host_blocks`, docs/architecture.md §5), a cached block evicted from the device pool is
copied to a host slot first, and a prefix that misses the device pool but hits the host is copied back instead of
recomputed. The block manager only decides the copies; `take_copies` hands them to the runner, which makes them
before the step's forward (offloads first: a block handed out again may be one being copied out).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine.request import Request


PROTECTED_SHARE = 0.5  # slru: most of the pool the protected free queue may hold


class Block:
    __slots__ = ("id", "ref_count", "hash", "key", "prev", "next", "hits", "protected")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # written once while cached; cleared on eviction
        self.key: tuple[int, tuple[int, ...]] | None = None  # (parent hash, tokens): rules out collisions
        self.prev: Block | None = None
        self.next: Block | None = None
        self.hits = 0  # prefix hits on its cached contents (slru: a free block hit before is evicted last)
        self.protected = False  # in the protected free queue


class FreeBlockQueue:
    """Intrusive doubly-linked list: O(1) append, popleft and removal from the middle (revive)."""

    def __init__(self, blocks: Iterable[Block]):
        self.head = Block(-1)  # sentinels
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.size

    def append(self, b: Block) -> None:
        last = self.tail.prev
        assert last is not None and b.prev is None and b.next is None
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.size += 1

    def remove(self, b: Block) -> None:
        assert b.prev is not None and b.next is not None, f"block {b.id} is not free"
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.size -= 1

    def popleft(self) -> Block:
        b = self.head.next
        assert b is not None and b is not self.tail, "no free blocks"
        self.remove(b)
        return b

    def __iter__(self) -> Iterator[Block]:
        b = self.head.next
        while b is not self.tail:
            assert b is not None
            yield b
            b = b.next


@dataclass
class PrefixHits:
    """A prompt's cached full blocks, in order: `blocks` in the device pool, then `host` (hash, slot) copied back
    from the host tier on allocation."""
    blocks: list[Block] = field(default_factory=list)
    host: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks) + len(self.host)


class HostTier:
    """The second tier: `num_slots` host slots holding evicted cached blocks, least recently used first out. With
    `slru`, an entry copied back at least once moves to a protected segment (at most PROTECTED_SHARE of the slots,
    its oldest going back), taken from only when the other is empty, as in the device pool. Slots being read this
    step (a copy back is pending) are never reused before the copies are made."""

    def __init__(self, num_slots: int, slru: bool = False):
        self.num_slots = num_slots
        self.slru = slru
        # hash -> (slot, key), least recently used first: entries not copied back yet (all of them without slru),
        # and the protected ones
        self.entries: OrderedDict[int, tuple[int, tuple[int, tuple[int, ...]]]] = OrderedDict()
        self.protected: OrderedDict[int, tuple[int, tuple[int, tuple[int, ...]]]] = OrderedDict()
        self.protected_cap = int(PROTECTED_SHARE * num_slots)
        self.free = list(range(num_slots - 1, -1, -1))
        self.reading: set[int] = set()  # slots a pending copy back reads
        self.writing: set[int] = set()  # slots a pending copy out writes
        self.evictions = 0

    def slots(self) -> dict[int, int]:
        """hash -> slot of every entry."""
        return {h: slot for seg in (self.entries, self.protected) for h, (slot, _) in seg.items()}

    def lookup(self, h: int, key: tuple[int, tuple[int, ...]]) -> int | None:
        hit = self.entries.get(h) or self.protected.get(h)
        return hit[0] if hit is not None and hit[1] == key else None

    def hit(self, h: int, slot: int) -> None:
        """Entry `h`, in `slot`, is being copied back this step."""
        self.reading.add(slot)
        if h in self.protected:
            self.protected.move_to_end(h)
        elif not self.slru:
            self.entries.move_to_end(h)
        else:
            self.protected[h] = self.entries.pop(h)
            if len(self.protected) > self.protected_cap:  # the oldest protected entry goes back, most recent there
                old, entry = self.protected.popitem(last=False)
                self.entries[old] = entry

    def store(self, h: int, key: tuple[int, tuple[int, ...]]) -> int | None:
        """A slot for a block to copy out (most recently used now), or None if every slot is being read."""
        for seg in (self.entries, self.protected):
            if h in seg:
                seg.move_to_end(h)
                return None  # already here (it was copied back from here): nothing to copy
        if not self.free:
            busy = self.reading | self.writing
            seg, victim = next(((seg, v) for seg in (self.entries, self.protected) for v, (slot, _) in seg.items()
                                if slot not in busy), (None, None))
            if victim is None:
                return None
            self.free.append(seg.pop(victim)[0])
            self.evictions += 1
        slot = self.free.pop()
        self.entries[h] = (slot, key)
        self.writing.add(slot)
        return slot


class BlockManager:
    """Hands out KV blocks to requests and shares full, identical prefix blocks between them.

    Contracts (only these write a request's `block_table`, `block_hashes` and computed / cached /
    committed counts):
    - `match_prefix(req)`: cached blocks for the longest run of `req`'s full blocks, never covering
      its last token (a fully cached prompt still recomputes that token to get logits).
    - `allocate(req, num_new_tokens, cached)`: all or nothing. On admission (`req` holds no blocks)
      it takes the `cached` blocks, which then count as computed and committed; then enough fresh
      blocks to hold `num_computed_tokens + num_new_tokens` tokens. A request's first allocation
      records its prefix hit (`num_cached_tokens`, the cache stats).
    - `commit(req, num_new_tokens)`: those tokens now have KV; publishes `req`'s newly full blocks.
    - `free(req)`: drops `req`'s references and resets its counts to 0; its blocks stay findable
      until evicted (LRU).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0,
                 eviction: str = "lru"):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)  # with slru: the probation segment
        # slru (segmented LRU): free cached blocks that were hit at least once wait here, and are evicted only when
        # the probation queue is empty; it holds at most PROTECTED_SHARE of the pool (the oldest are demoted)
        self.slru = eviction == "slru"
        self.protected = FreeBlockQueue([])
        self.protected_cap = int(PROTECTED_SHARE * num_blocks)
        self.cached: dict[int, Block] = {}  # hash -> block
        self.pinned: list[Block] = []
        self.host = HostTier(num_host_blocks, self.slru) if num_host_blocks and enable_prefix_caching else None
        self._offloads: list[tuple[int, int]] = []  # (device block, host slot) to copy out before the next forward
        self._loads: list[tuple[int, int]] = []  # (host slot, device block) to copy back, after the offloads
        self.prefix_cache_queries = 0  # prompt tokens looked up, once per request (its first allocation)
        self.prefix_cache_hits = 0  # of those, served from the cache (either tier)
        self.host_cache_hits = 0  # of those, copied back from the host tier
        self.host_blocks_offloaded = 0
        self.host_blocks_loaded = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.protected)

    def _take(self, b: Block) -> None:
        """Out of whichever free queue holds it."""
        (self.protected if b.protected else self.free_queue).remove(b)
        b.protected = False

    def _release(self, b: Block) -> None:
        """Its last holder let go: into a free queue, still cached."""
        if self.slru and b.hash is not None and b.hits:
            b.protected = True
            self.protected.append(b)
            if len(self.protected) > self.protected_cap:  # the oldest protected block goes back on probation
                d = self.protected.popleft()
                d.protected = False
                self.free_queue.append(d)
        else:
            self.free_queue.append(b)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- hashing ---------------------------------------------------------------------------

    def hash_blocks(self, req: Request) -> list[int]:
        """Extends `req.block_hashes` to cover every full block of `req.token_ids`."""
        assert not req.num_placeholders, f"{req}: a token it hashes is not sampled yet"
        return self._chain_hashes(req.token_ids, req.block_hashes)

    def _chain_hashes(self, token_ids: list[int], hashes: list[int]) -> list[int]:
        """Extends `hashes` (in place) to cover every full block of `token_ids`; returns it."""
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else 0
            hashes.append(hash((parent, tuple(token_ids[i * bs : (i + 1) * bs]))))
        return hashes

    def _lookup(self, token_ids: list[int], hashes: list[int], num_blocks: int) -> list[Block]:
        bs, hits = self.block_size, []
        for i in range(num_blocks):
            b = self.cached.get(hashes[i])
            parent = hashes[i - 1] if i else 0
            if b is None or b.key != (parent, tuple(token_ids[i * bs : (i + 1) * bs])):
                break
            hits.append(b)
        return hits

    def match_prefix(self, req: Request) -> PrefixHits:
        if not self.enable_prefix_caching:
            return PrefixHits()
        hashes = self.hash_blocks(req)
        n = (req.num_tokens - 1) // self.block_size
        hits = PrefixHits(self._lookup(req.token_ids, hashes, n))
        if self.host is not None:  # the device pool's run ended: go on in the host tier
            bs, toks = self.block_size, req.token_ids
            for i in range(len(hits.blocks), n):
                if hashes[i] in self.cached:  # on the device after a gap: stop here (no mixing past a hole)
                    break
                slot = self.host.lookup(hashes[i], (hashes[i - 1] if i else 0, tuple(toks[i * bs : (i + 1) * bs])))
                if slot is None:
                    break
                hits.host.append((hashes[i], slot))
        return hits

    # -- allocation ------------------------------------------------------------------------

    def can_allocate(self, req: Request, num_new_tokens: int, cached: PrefixHits | None = None) -> bool:
        cached = cached or PrefixHits()
        num_computed = req.num_computed_tokens + len(cached) * self.block_size
        fresh = self.blocks_needed(num_computed + num_new_tokens) - len(req.block_table) - len(cached.blocks)
        revived = sum(1 for b in cached.blocks if b.ref_count == 0)
        return max(fresh, 0) + revived <= self.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int, cached: PrefixHits | None = None) -> bool:
        """`cached`: `match_prefix(req)`, on admission."""
        if not cached and req.admitted and req.num_computed_tokens + num_new_tokens <= len(req.block_table) * self.block_size:
            return True  # most decode steps: the last block has room, nothing to take or count
        cached = cached or PrefixHits()
        if cached:
            assert not req.block_table and req.num_computed_tokens == 0, f"{req}: prefix hits are for admission only"
        if not self.can_allocate(req, num_new_tokens, cached):
            return False
        device, host = cached.blocks, cached.host
        for b in device:
            if b.ref_count == 0:
                self._take(b)
            b.ref_count += 1
            b.hits += not req.admitted  # a preempted request coming back is not a second user
            req.block_table.append(b.id)
        for h, slot in host:  # NOTE: first, so the evictions below cannot take these slots (or their entries)
            self.host.hit(h, slot)
        for i, (h, slot) in enumerate(host, start=len(req.block_table)):  # copied back: cached on the device again
            b = self._fresh()
            b.hits = 1  # a hit, from the host tier
            b.hash, b.key = h, (req.block_hashes[i - 1] if i else 0,
                                tuple(req.token_ids[i * self.block_size : (i + 1) * self.block_size]))
            self.cached[h] = b
            req.block_table.append(b.id)
            self._loads.append((slot, b.id))
        req.num_computed_tokens += len(cached) * self.block_size
        req.num_committed_blocks += len(cached)  # they came from the cache: published already
        for _ in range(self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)):
            req.block_table.append(self._fresh().id)
        if not req.admitted:  # NOTE: a preempted request is looked up again, but counted once
            req.admitted = True
            # (a resumed request's hits may cover its checkpoint's output too: the prompt's are what it reports)
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            if not req.announced:  # (one resumed after its start was counted in the engine it came from)
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += req.num_cached_tokens
                self.host_cache_hits += min(len(host) * self.block_size, req.num_prompt_tokens)
        return True

    def _fresh(self) -> Block:
        """The least recently used free block, evicted from the cache (copied out first, with a host tier), held."""
        b = self.free_queue.popleft() if len(self.free_queue) or not len(self.protected) else self.protected.popleft()
        b.protected = False
        self._evict(b)
        b.ref_count = 1
        return b

    def _evict(self, b: Block) -> None:
        b.hits = 0
        if b.hash is not None:
            if self.cached.get(b.hash) is b:
                del self.cached[b.hash]
                if self.host is not None and (slot := self.host.store(b.hash, b.key)) is not None:
                    self._offloads.append((b.id, slot))
            b.hash = b.key = None

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the next forward needs, offloads (device block -> host slot) first, then copies back (host
        slot -> device block); the caller makes them before it runs. Their slots may be reused from now on."""
        offloads, loads, self._offloads, self._loads = self._offloads, self._loads, [], []
        if self.host is not None:
            self.host.reading.clear()
            self.host.writing.clear()
            self.host_blocks_offloaded += len(offloads)
            self.host_blocks_loaded += len(loads)
        return offloads, loads

    def commit(self, req: Request, num_new_tokens: int) -> None:
        """Marks `num_new_tokens` more of `req`'s tokens computed; publishes its newly full blocks."""
        self.advance(req, num_new_tokens)
        self.publish(req)

    def advance(self, req: Request, num_new_tokens: int) -> None:
        """`commit` without publishing (async scheduling: the step computing them is still running; `publish` once it
        is done, and a step that failed goes back with a negative count)."""
        req.num_computed_tokens += num_new_tokens
        assert 0 <= req.num_computed_tokens <= len(req.block_table) * self.block_size, f"{req} computed past its blocks"

    def publish(self, req: Request) -> None:
        """Puts `req`'s full blocks of computed tokens not published yet in the prefix cache."""
        n_full = req.num_computed_tokens // self.block_size
        if self.enable_prefix_caching and n_full > req.num_committed_blocks:
            hashes = self.hash_blocks(req)
            bs, toks = self.block_size, req.token_ids
            for i in range(req.num_committed_blocks, n_full):
                b = self.blocks[req.block_table[i]]
                if b.hash is not None or hashes[i] in self.cached:
                    continue  # already cached, or an identical block computed concurrently is
                b.hash = hashes[i]
                b.key = (hashes[i - 1] if i else 0, tuple(toks[i * bs : (i + 1) * bs]))
                self.cached[b.hash] = b
        req.num_committed_blocks = max(req.num_committed_blocks, n_full)

    def trim(self, req: Request) -> None:
        """Gives back `req`'s blocks past the ones its tokens need (those that held only rejected draft tokens)."""
        keep = self.blocks_needed(req.num_tokens)
        while len(req.block_table) > keep:
            b = self.blocks[req.block_table.pop()]
            assert b.ref_count == 1 and b.hash is None, f"block {b.id} of {req} is shared or cached"
            b.ref_count = 0
            self._release(b)
        req.block_table_seen = min(req.block_table_seen, len(req.block_table))  # (the step inputs' copy: its tail goes)

    def free(self, req: Request) -> None:
        """Drops `req`'s blocks; it has nothing computed any more (preempted: recomputed when readmitted)."""
        # NOTE: reversed, so a request's tail blocks (least likely shared) are evicted first.
        for bid in reversed(req.block_table):
            b = self.blocks[bid]
            assert b.ref_count > 0, f"double free of block {bid}"
            b.ref_count -= 1
            if b.ref_count == 0:
                self._release(b)
        req.block_table = []
        req.num_computed_tokens = req.num_committed_blocks = req.num_draft_computed = 0

    # -- pinning ---------------------------------------------------------------------------

    def pin(self, token_ids: list[int]) -> int:
        """Pins the cached full blocks of `token_ids` forever; returns the number of tokens pinned."""
        hashes = self._chain_hashes(token_ids, [])
        hits = self._lookup(token_ids, hashes, len(hashes))
        for b in hits:
            if b.ref_count == 0:
                self._take(b)
            b.ref_count += 1
            self.pinned.append(b)
        return len(hits) * self.block_size

    def adopt_pinned(self, token_ids: list[int]) -> list[tuple[int, bool]]:
        """Pins the full blocks of `token_ids` as `pin` pins computed ones: a block already cached on the device is
        pinned as it is, the others are fresh blocks, cached under their hashes. Returns (block id, fresh) per
        block: the caller writes the fresh ones' KV (from a store) before any step reads them, after the copies
        this may have decided (`take_copies`: evicted blocks are copied out first), or `unpin` them all."""
        bs = self.block_size
        hashes = self._chain_hashes(token_ids, [])
        out = []
        for i, h in enumerate(hashes):
            key = (hashes[i - 1] if i else 0, tuple(token_ids[i * bs : (i + 1) * bs]))
            b = self.cached.get(h)
            if b is not None and b.key == key:
                if b.ref_count == 0:
                    self._take(b)
                b.ref_count += 1
                out.append((b.id, False))
            else:
                b = self._fresh()
                b.hash, b.key = h, key
                self.cached[h] = b
                out.append((b.id, True))
            self.pinned.append(b)
        return out

    def adopt_cache(self, old: BlockManager) -> None:
        """A new manager over `old`'s pool (the same tensors, its KV intact): every block `old` had cached is cached
        here too, free, in `old`'s recency order (blocks held then count as the most recent); the rest are evicted
        first. Nothing is held or pinned (pins are made again)."""
        assert not self.cached and self.num_free_blocks == self.num_blocks, "adopt_cache is for a new manager"
        held = [b for b in old.blocks if b.ref_count and b.hash is not None and old.cached.get(b.hash) is b]
        # NOTE: not a block whose copy back from the host tier was decided but never made (the step failed between
        # the two): its hash is cached, its KV is not there
        unloaded = {bid for _, bid in old._loads}
        order = [b for q in (old.free_queue, old.protected) for b in q if b.hash is not None] + held
        order = [b for b in order if b.id not in unloaded]
        for q in (self.free_queue, self.protected):
            for b in list(q):
                q.remove(b)
        cached_ids = {b.id for b in order}
        for b in self.blocks:
            if b.id not in cached_ids:
                self.free_queue.append(b)
        for ob in order:
            b = self.blocks[ob.id]
            b.hash, b.key, b.hits = ob.hash, ob.key, ob.hits
            self.cached[b.hash] = b
            self._release(b)

    def unpin(self, adopted: list[tuple[int, bool]]) -> None:
        """Undoes `adopt_pinned` (its KV could not be written): fresh blocks leave the cache, all are released."""
        for bid, fresh in adopted:
            b = self.blocks[bid]
            self.pinned.remove(b)
            if fresh:
                self._evict(b)
            b.ref_count -= 1
            if b.ref_count == 0:
                self._release(b)

    # -- checks ----------------------------------------------------------------------------

    def check_integrity(self, live: Iterable[Request] = ()) -> None:
        refs = [0] * self.num_blocks
        for req in live:
            assert len(req.block_table) == len(set(req.block_table)), f"{req} holds a block twice"
            assert len(req.block_table) * self.block_size >= req.num_computed_tokens, f"{req} lacks blocks"
            assert req.num_committed_blocks <= req.num_computed_tokens // self.block_size, f"{req} committed too much"
            for bid in req.block_table:
                refs[bid] += 1
        for b in self.pinned:
            refs[b.id] += 1
        free = list(self.free_queue) + list(self.protected)
        assert len(free) == self.num_free_blocks == len({b.id for b in free}), "free queue corrupt"
        assert all(b.protected for b in self.protected) and not any(b.protected for b in self.free_queue), \
            "protected flags wrong"
        assert len(self.protected) <= max(self.protected_cap, 0) or not self.slru, "protected queue over its cap"
        free_ids = {b.id for b in free}
        for b in self.blocks:
            assert b.ref_count == refs[b.id], f"block {b.id}: ref_count {b.ref_count} != {refs[b.id]} holders"
            assert (b.ref_count == 0) == (b.id in free_ids), f"block {b.id}: free-queue membership wrong"
            if b.hash is not None:
                assert self.cached.get(b.hash) is b, f"block {b.id}: hashed but not findable"
        for h, b in self.cached.items():
            assert b.hash == h, f"cache entry {h} points at block {b.id} with hash {b.hash}"
        for queue in (self.free_queue, self.protected):
            prev = queue.head
            for b in queue:
                assert b.prev is prev, "free queue links broken"
                prev = b
        if self.host is not None:
            used = list(self.host.slots().values())
            assert len(used) == len(self.host.entries) + len(self.host.protected), "an entry in both segments"
            assert len(self.host.protected) <= self.host.protected_cap, "protected host segment over its cap"
            assert len(used) == len(set(used)) and not set(used) & set(self.host.free), "host slots corrupt"
            assert len(used) + len(self.host.free) == self.host.num_slots, "host slots lost"
