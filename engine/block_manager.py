"""Paged KV block pool with a prefix cache; the one writer of each request's KV bookkeeping.

Invariants (checked by `check_integrity`): a block's `ref_count` equals the number of live block
tables (plus pins) holding it; exactly the blocks with `ref_count == 0` sit in the free queue, in
LRU order; a hashed block is findable under its hash until it is handed out again (evicted).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from engine.request import Request


class Block:
    __slots__ = ("id", "ref_count", "hash", "key", "prev", "next")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # written once while cached; cleared on eviction
        self.key: tuple[int, tuple[int, ...]] | None = None  # (parent hash, tokens): rules out collisions
        self.prev: Block | None = None
        self.next: Block | None = None


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

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}  # hash -> block
        self.pinned: list[Block] = []
        self.prefix_cache_queries = 0  # prompt tokens looked up, once per request (its first allocation)
        self.prefix_cache_hits = 0  # of those, served from the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- hashing ---------------------------------------------------------------------------

    def hash_blocks(self, req: Request) -> list[int]:
        """Extends `req.block_hashes` to cover every full block of `req.token_ids`."""
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

    def match_prefix(self, req: Request) -> list[Block]:
        if not self.enable_prefix_caching:
            return []
        hashes = self.hash_blocks(req)
        return self._lookup(req.token_ids, hashes, (req.num_tokens - 1) // self.block_size)

    # -- allocation ------------------------------------------------------------------------

    def can_allocate(self, req: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> bool:
        num_computed = req.num_computed_tokens + len(cached) * self.block_size
        fresh = self.blocks_needed(num_computed + num_new_tokens) - len(req.block_table) - len(cached)
        revived = sum(1 for b in cached if b.ref_count == 0)
        return max(fresh, 0) + revived <= self.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> bool:
        if cached:
            assert not req.block_table and req.num_computed_tokens == 0, f"{req}: prefix hits are for admission only"
        if not self.can_allocate(req, num_new_tokens, cached):
            return False
        for b in cached:
            if b.ref_count == 0:
                self.free_queue.remove(b)
            b.ref_count += 1
            req.block_table.append(b.id)
        req.num_computed_tokens += len(cached) * self.block_size
        req.num_committed_blocks += len(cached)  # they came from the cache: published already
        for _ in range(self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_count = 1
            req.block_table.append(b.id)
        if not req.admitted:  # NOTE: a preempted request is looked up again, but counted once
            req.admitted = True
            req.num_cached_tokens = req.num_computed_tokens
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += req.num_cached_tokens
        return True

    def _evict(self, b: Block) -> None:
        if b.hash is not None:
            if self.cached.get(b.hash) is b:
                del self.cached[b.hash]
            b.hash = b.key = None

    def commit(self, req: Request, num_new_tokens: int) -> None:
        """Marks `num_new_tokens` more of `req`'s tokens computed; publishes its newly full blocks."""
        req.num_computed_tokens += num_new_tokens
        assert req.num_computed_tokens <= len(req.block_table) * self.block_size, f"{req} computed past its blocks"
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

    def free(self, req: Request) -> None:
        """Drops `req`'s blocks; it has nothing computed any more (preempted: recomputed when readmitted)."""
        # NOTE: reversed, so a request's tail blocks (least likely shared) are evicted first.
        for bid in reversed(req.block_table):
            b = self.blocks[bid]
            assert b.ref_count > 0, f"double free of block {bid}"
            b.ref_count -= 1
            if b.ref_count == 0:
                self.free_queue.append(b)
        req.block_table = []
        req.num_computed_tokens = req.num_committed_blocks = 0

    # -- pinning ---------------------------------------------------------------------------

    def pin(self, token_ids: list[int]) -> int:
        """Pins the cached full blocks of `token_ids` forever; returns the number of tokens pinned."""
        hashes = self._chain_hashes(token_ids, [])
        hits = self._lookup(token_ids, hashes, len(hashes))
        for b in hits:
            if b.ref_count == 0:
                self.free_queue.remove(b)
            b.ref_count += 1
            self.pinned.append(b)
        return len(hits) * self.block_size

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
        free = list(self.free_queue)
        assert len(free) == len(self.free_queue) == len({b.id for b in free}), "free queue corrupt"
        free_ids = {b.id for b in free}
        for b in self.blocks:
            assert b.ref_count == refs[b.id], f"block {b.id}: ref_count {b.ref_count} != {refs[b.id]} holders"
            assert (b.ref_count == 0) == (b.id in free_ids), f"block {b.id}: free-queue membership wrong"
            if b.hash is not None:
                assert self.cached.get(b.hash) is b, f"block {b.id}: hashed but not findable"
        for h, b in self.cached.items():
            assert b.hash == h, f"cache entry {h} points at block {b.id} with hash {b.hash}"
        prev = self.free_queue.head
        for b in free:
            assert b.prev is prev, "free queue links broken"
            prev = b
