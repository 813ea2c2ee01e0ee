"""Builds each engine step under the token budget: `mixed`, `prefill_first` or `static`.

No prefill or decode phase exists: every request has `num_computed_tokens` and a step gives it
`n` more. Invariants: no step exceeds `max_num_batched_tokens` tokens (prompts are only unchunked
in the baselines, whose budget is raised to fit one whole prompt) or `max_num_seqs` requests; a
preempted request is requeued at the front, never lost.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Request, Status


@dataclass
class Batch:
    reqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, req: Request, n: int) -> None:
        self.reqs.append(req)
        self.num_new_tokens.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.reqs)

    def samples(self) -> list[bool]:
        """Per request: does this step reach its last token (so a new token is sampled)?"""
        return [r.num_computed_tokens + n == r.num_tokens for r, n in zip(self.reqs, self.num_new_tokens)]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the tail is preempted first
        # NOTE: the baselines never chunk, so their budget must fit the longest allowed prompt.
        self.whole_prompt_budget = max(config.max_num_batched_tokens, max_model_len)
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        policy = self.config.scheduling
        if policy == "mixed":
            budget = self._schedule_decodes(batch, self.config.max_num_batched_tokens)
            budget = self._schedule_partial_prefills(batch, budget)
            self._admit(batch, budget, chunked=True)
        elif policy == "prefill_first":
            if not self._admit(batch, self.whole_prompt_budget, chunked=False):
                self._schedule_decodes(batch, self.config.max_num_batched_tokens)
        else:  # static
            if not self.running:
                self._admit(batch, self.whole_prompt_budget, chunked=False)
            else:
                self._schedule_decodes(batch, self.config.max_num_batched_tokens)
        return batch

    # -- building blocks -------------------------------------------------------------------

    def _schedule_decodes(self, batch: Batch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(batch) < self.config.max_num_seqs:
            req = self.running[i]
            i += 1
            if req.is_prefilling:
                continue
            if self._allocate_or_preempt(req, 1, batch):
                batch.add(req, 1)
                budget -= 1
            else:
                self._preempt(req)
                i -= 1
        return budget

    def _schedule_partial_prefills(self, batch: Batch, budget: int) -> int:
        partial = 0
        for req in list(self.running):
            if partial >= self.config.max_num_partial_prefills or budget <= 0 or len(batch) >= self.config.max_num_seqs:
                break
            if req.status is not Status.RUNNING or not req.is_prefilling:
                continue  # preempted meanwhile, or decoding
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.chunk_limit)
            if self._allocate_or_preempt(req, n, batch):
                batch.add(req, n)
                budget -= n
                partial += 1
        return budget

    def _admit(self, batch: Batch, budget: int, chunked: bool) -> int:
        """Admits waiting requests first-come-first-served; returns how many were admitted."""
        cfg, admitted = self.config, 0
        partial = sum(1 for r in batch.reqs if r.is_prefilling)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and len(batch) < cfg.max_num_seqs:
            req = self.waiting[0]
            cached = self.bm.match_prefix(req)
            num_cached = len(cached) * self.bm.block_size
            remaining = req.num_tokens - num_cached
            if chunked and remaining > 1 and partial >= cfg.max_num_partial_prefills:
                break
            n = min(remaining, budget, cfg.chunk_limit) if chunked else remaining
            if n > budget:
                break  # an unchunked prompt waits for a step of its own
            req.num_computed_tokens = num_cached
            if not self.bm.allocate(req, n, cached):
                req.num_computed_tokens = 0
                break
            req.num_committed_blocks = len(cached)
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = num_cached
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += min(num_cached, req.num_prompt_tokens)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.add(req, n)
            budget -= n
            admitted += 1
            partial += remaining > 1
        return admitted

    def _allocate_or_preempt(self, req: Request, n: int, batch: Batch) -> bool:
        """Allocates for `req`, preempting later-admitted, unscheduled requests while needed."""
        while not self.bm.allocate(req, n):
            victim = next((r for r in reversed(self.running) if r is not req and r not in batch.reqs), None)
            if victim is None or self.running.index(victim) < self.running.index(req):
                return False  # never preempt an older request for a younger one
            self._preempt(victim)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.num_committed_blocks = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # -- after the step --------------------------------------------------------------------

    def postprocess(self, batch: Batch) -> None:
        for req, n in zip(batch.reqs, batch.num_new_tokens):
            req.num_computed_tokens += n
            req.num_committed_blocks = self.bm.commit(req, req.num_committed_blocks)

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.bm.free(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
