"""Builds each engine step under the token budget: `mixed`, `prefill_first` or `static`.

No prefill or decode phase exists: every request has `num_computed_tokens` and a step gives it
`n` more. Invariants: no step exceeds `max_num_batched_tokens` tokens (prompts are only unchunked
in the baselines, whose budget is raised to fit one whole prompt) or `max_num_seqs` requests; a
preempted request is requeued at the front, never lost. The block manager alone writes a
request's KV bookkeeping; the scheduler only reads it. Under KV pressure `mixed` admits less
(`engine/pressure.py`); whatever runs keeps running, and with nothing running the head of `waiting` is admitted.

Requests carry their client (`Request.client`: a server's peer address). With one client, `waiting` is first come,
first served. With more, clients share the seats: `waiting` is taken in order of the running requests each one's
client would then have (`_admission_order`), and under `mixed` a client's waiting request takes a seat, or the KV
blocks of its first chunk, from a client with two or more running requests more (`_rebalance`: its youngest
is preempted). So one client that fills every seat with long requests delays another's first token by a step, not
until its own requests end. With an inter-token latency target (`itl_slo_ms`), clients share a step's decodes too:
when the decodes that fit the target are fewer than the clients want, `decode_shares` splits them (a client with few
streams decodes all of them every step; a client's prompt gets its share of the step's time; one with more than its
share has its streams take turns, `_deferred_decodes`), so one client's many streams (a request with `n=128`) do not
slow every other client's, nor hold back a newcomer's first token.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator
from itertools import chain
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager, PrefixHits
from engine.config import EngineConfig
from engine.pressure import PressureLadder
from engine.request import Request, Status
from engine.spec import Speculation
from engine.step_cost import StepCost

if TYPE_CHECKING:
    from engine.cuda_graphs import StepGraphs


class RequestQueue:
    """Requests in order, with O(1) append at either end, popleft and removal from anywhere."""

    def __init__(self) -> None:
        self._reqs: OrderedDict[Request, None] = OrderedDict()

    def append(self, req: Request) -> None:
        self._reqs[req] = None

    def appendleft(self, req: Request) -> None:
        self._reqs[req] = None
        self._reqs.move_to_end(req, last=False)

    def first(self) -> Request:
        return next(iter(self._reqs))

    def popleft(self) -> Request:
        return self._reqs.popitem(last=False)[0]

    def remove(self, req: Request) -> None:
        del self._reqs[req]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._reqs)

    def __repr__(self) -> str:
        return f"RequestQueue({list(self._reqs)})"


@dataclass
class Batch:
    reqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # taken from the waiting queue for this step, in order
    _members: set[Request] = field(default_factory=set, init=False, repr=False)

    def add(self, req: Request, n: int) -> None:
        self.reqs.append(req)
        self.num_new_tokens.append(n)
        self._members.add(req)

    def __contains__(self, req: Request) -> bool:
        return req in self._members

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.reqs)

    def samples(self) -> list[bool]:
        """Per request: does this step reach its last token (so a new token is sampled)? (Its draft tokens, if
        any, come after that token.)"""
        return [r.num_computed_tokens + n - len(r.draft) == r.num_tokens for r, n in zip(self.reqs, self.num_new_tokens)]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int, vocab_size: int = 0):
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting = RequestQueue()  # first come, first served; the preempted go back to the front
        self.running = RequestQueue()  # admission order: the tail is preempted first
        # NOTE: the baselines never chunk, so their budget must fit the longest allowed prompt.
        self.whole_prompt_budget = max(config.max_num_batched_tokens, max_model_len)
        self.num_preemptions = 0  # for lack of KV blocks: the pressure ladder's signal
        self.num_fair_preemptions = 0  # to give another client its share (`_rebalance`)
        self.num_deferred_decodes = 0  # decodes a step left for a later one, for another client's share (itl_slo_ms)
        # a client over its share of decodes: its running requests, next to decode first (`_deferred_decodes`)
        self.turns: dict[Hashable, OrderedDict[Request, None]] = {}
        # a client whose share of the step holds prompt time: its prompt tokens, which others' prefills leave it
        self.prompt_reserve: dict[Hashable, int] = {}
        self.num_shared_steps = 0  # steps whose decodes were shared: whose turn an uneven split's extra decode is
        self.clients: Counter[Hashable] = Counter()  # unfinished (waiting or running) requests per client
        self.granted: Request | None = None  # the waiting request `_rebalance` took a seat for: the seat is its
        # prompt tokens one step computes for requests that want their prompt's logprobs: a row of logits over the
        # vocabulary each, PROMPT_LOGPROBS_BYTES of them in all (256 rows at a vocabulary of 262,144, 8,192 at 8,192)
        self.prompt_logprob_rows = prompt_logprob_rows(vocab_size)
        self.prompt_rows = self.prompt_logprob_rows
        # with config.itl_slo_ms or speculation: fed by the engine after every step, sizes prompt chunks, prices drafts
        self.step_cost = StepCost()
        self.prompt_budget = config.max_num_batched_tokens  # prompt tokens the last `mixed` step could take
        self.pressure = PressureLadder(block_manager.num_blocks)  # `mixed` only: the others stay `normal`
        self.spec = Speculation(config, max_model_len, self.step_cost) if config.speculative else None

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.clients[req.client] += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: bool = True, graphs: StepGraphs | None = None) -> Batch:
        """The next step's batch; with `drafts=False` no request drafts (speculation is skipped this step). `graphs`:
        the runner's CUDA graphs, if any: the step-cost model prices a step they do not replay as eager (the prompt
        budget of `itl_slo_ms`, and speculation's drafts)."""
        batch = Batch()
        self.prompt_rows = self.prompt_logprob_rows  # (what this step's chunks with prompt logprobs may take)
        policy = self.config.scheduling
        if policy == "mixed":
            self._rebalance()
            deferred = self._deferred_decodes()  # (drafts would take time the target left to the deferred decodes)
            budget = self._schedule_decodes(batch, self.config.max_num_batched_tokens, drafts and not deferred,
                                            graphs, deferred)
            if self.config.itl_slo_ms is not None:  # the prompt tokens a step can add and still meet the target
                drafting = [r for r in batch.reqs if r.draft]
                extra = 0.0
                if drafting:
                    extra = self.spec.seconds([len(r.draft) for r in drafting], self._catchup(drafting)) or 0.0
                floor = min(budget, self.bm.block_size)
                decodes, draft_tokens = len(batch), sum(len(r.draft) for r in drafting)
                budget = self.step_cost.prompt_budget(
                    decodes, self._next_prompt_context(), self.config.itl_slo_ms / 1e3, floor=floor, cap=budget,
                    extra_s=extra, eager_from=None if graphs is None else graphs.eager_from(decodes, draft_tokens))
            self.prompt_budget = budget
            cut: list[tuple[Request, int]] = []  # (prompts under way that others' reserves cut, and their chunks)
            budget = self._schedule_partial_prefills(batch, budget, cut)
            # NOTE: after the running requests took their blocks, so this step's preemptions gate its admissions
            self.pressure.observe(self.num_preemptions, self.bm.num_free_blocks, len(self.running))
            before = batch.num_tokens if cut else 0
            self._admit(batch, budget, chunked=True)
            if cut:
                self._top_up(batch, cut, budget - (batch.num_tokens - before))
        elif policy == "prefill_first":
            if not self._admit(batch, self.whole_prompt_budget, chunked=False):
                self._schedule_decodes(batch, self.config.max_num_batched_tokens, drafts, graphs)
        else:  # static
            if not self.running:
                self._admit(batch, self.whole_prompt_budget, chunked=False)
            else:
                self._schedule_decodes(batch, self.config.max_num_batched_tokens, drafts, graphs)
        return batch

    def _next_prompt_context(self) -> int:
        """Tokens already computed of the prompt the next chunk comes from (its attention reads them all)."""
        for req in self.running:
            if req.status is Status.RUNNING and req.is_prefilling:
                return req.num_computed_tokens
        return 0

    # -- building blocks -------------------------------------------------------------------

    def _decodes(self, req: Request) -> bool:
        """Does a running request take a decode this step?"""
        if req.status is not Status.RUNNING or req.is_prefilling:
            return False  # preempted meanwhile, or mid-prompt
        if req.num_placeholders and req.reached_length(self.max_model_len):
            return False  # its token in the running step (async scheduling) ends it: nothing more to compute
        # its grammar's next mask is being made off the step (engine/structured.py)
        return req.matcher is None or not req.waits_for_mask

    def _schedule_decodes(self, batch: Batch, budget: int, drafts: bool, graphs: StepGraphs | None,
                          deferred: set[Request] | frozenset[Request] = frozenset()) -> int:
        first = len(batch)
        seats = self._seats()
        # NOTE: with more clients, those holding fewer seats first, so a client's few streams take their blocks
        # before another's many, whose own streams are then the ones `_victim` finds outside the batch
        order = list(self.running) if seats is None else sorted(self.running, key=lambda r: seats[r.client])
        for req in order:
            if budget <= 0 or len(batch) >= self.config.max_num_seqs:
                break
            if not self._decodes(req) or req in deferred:
                continue
            req.draft = []  # _schedule_drafts may give it one
            if self._allocate_or_preempt(req, 1, batch):
                batch.add(req, 1)
                budget -= 1
            else:
                self._preempt(req)
        decodes = len(batch) - first
        if (self.spec is not None and drafts and decodes and self.spec.enabled_for(decodes)
                and self.spec.may_pay(decodes, graphs)):
            budget = self._schedule_drafts(batch, first, budget, graphs)
        return budget

    def _deferred_decodes(self) -> set[Request]:
        """`mixed` with `itl_slo_ms`: the running requests whose decode waits for a later step, so that every client's
        share of the decodes that fit the target (`StepCost.decodes_within`) runs in this one (`decode_shares`). A
        client's demand is its decodes and the time of its prompt tokens this step (`_prompts`, priced in decodes by
        `StepCost.decodes_for`, at most what an equal split between the clients with work in the step leaves beside
        its decodes), so a client whose first token is still to come gets a share of the step too, not only what the
        others' decodes leave. A client over its share decodes at most its share, its streams taking turns (`turns`:
        a queue of its running requests, new ones at its back; those that decode go to its back, one that cannot
        decode this step keeps its place). Empty with one client, while everything fits, or where sharing would
        leave no client all it wants. The prompt time a client's share holds (all it wants, where everything fits) is
        kept for its prompts in the step's prompt budget (`prompt_reserve`): another client's prompt under way takes
        what the others' reserves leave. The decodes leave at least the time of the block of prompt a step always
        takes (`schedule`'s floor), so a crowd's long prompt under way does not push the step past the target."""
        self.prompt_reserve = {}
        if self.config.itl_slo_ms is None or len(self.clients) < 2:
            return set()
        capacity = self.step_cost.decodes_within(self.config.itl_slo_ms / 1e3)
        if capacity is None or capacity == math.inf or capacity < 1:  # (< 1: no split, and decodes may cost 0)
            self.turns.clear()
            return set()
        by_client: dict[Hashable, list[Request]] = {}
        for req in self.running:
            if self._decodes(req):
                by_client.setdefault(req.client, []).append(req)
        prompts = self._prompts()
        clients = by_client.keys() | {req.client for req, _, _ in prompts}
        shares = None
        if by_client and len(clients) > 1:
            capacity = int(capacity)
            decodes = {client: len(reqs) for client, reqs in by_client.items()}
            # a client's prompts take at most what an equal split of the step leaves beside its decodes, so a client
            # with a stream and a new prompt wants no more than the split (a demand over it, with every other client
            # over it too, would leave no split)
            cap = capacity // len(clients)
            wanted: Counter[Hashable] = Counter()
            for req, tokens, context in prompts:
                wanted[req.client] += self.step_cost.decodes_for(tokens, context)
            demands = dict(decodes)
            for client, n in wanted.items():
                room = cap - decodes.get(client, 0)
                if room > 0 and n > 0:
                    demands[client] = demands.get(client, 0) + math.ceil(min(n, room))
            shares, granted = self._split(demands, decodes, capacity)
            # a step with a prompt takes at least a block of it (`schedule`'s floor): where the decodes would leave
            # less than its time, they are split again in what is left beside it
            floor = max((self.step_cost.decodes_for(min(n, self.bm.block_size), context)
                         for _, n, context in prompts), default=0.0)
            running = sum(decodes.values()) if shares is None else sum(min(shares[c], n) for c, n in decodes.items())
            if capacity - running < floor:
                shares, granted = self._split(demands, decodes, math.floor(capacity - floor))
            if granted is not None:
                # (a client the equal split left no room for has no demand, so no share)
                self.prompt_reserve = self._reserve(prompts, {c: granted[c] - decodes.get(c, 0) for c in wanted
                                                              if c in granted})
        turns, self.turns = self.turns, {}
        if shares is None:
            return set()
        self.num_shared_steps += 1
        deferred: set[Request] = set()
        for client, reqs in by_client.items():
            if shares[client] >= len(reqs):
                continue
            queue = turns.get(client) or OrderedDict()
            for req in [r for r in queue if r.status is not Status.RUNNING]:
                del queue[req]  # (ended or preempted)
            for req in reqs:
                queue.setdefault(req, None)  # (a newcomer: last)
            now = set(reqs)
            chosen = [r for r in queue if r in now][:shares[client]]
            for req in chosen:
                queue.move_to_end(req)
            deferred.update(now.difference(chosen))
            self.turns[client] = queue
        self.num_deferred_decodes += len(deferred)
        return deferred

    def _split(self, demands: dict[Hashable, int], decodes: dict[Hashable, int],
               capacity: int) -> tuple[dict[Hashable, int] | None, dict[Hashable, int] | None]:
        """`decode_shares` of `capacity` by `demands` (decodes and prompt time), or where no such split can be made,
        of the decodes alone; and what each client is granted: its share, or all it wants where everything fits (so a
        long prompt under way, its own part counted, takes no more than that from the others' prompts), or None."""
        shares = decode_shares(demands, capacity, self.num_shared_steps)
        granted = shares if shares is not None else demands if sum(demands.values()) <= capacity else None
        if shares is None and demands != decodes:  # (as without the prompts: the decodes alone may split)
            shares = decode_shares(decodes, capacity, self.num_shared_steps)
        return shares, granted

    def _reserve(self, prompts: list[tuple[Request, int, int]], room: dict[Hashable, int]) -> dict[Hashable, int]:
        """The prompt tokens of `prompts` that fit in each client's `room` (decodes' time), chunk by chunk in order."""
        reserve: dict[Hashable, int] = {}
        for req, tokens, context in prompts:
            left = room.get(req.client, 0)
            if left <= 0:
                continue
            cost = self.step_cost.decodes_for(tokens, context)
            n = tokens if cost <= left else min(tokens, self.step_cost.tokens_for(left, context))
            room[req.client] = left - cost
            if n > 0:
                reserve[req.client] = reserve.get(req.client, 0) + n
        return reserve

    def _prompts(self) -> list[tuple[Request, int, int]]:
        """The prompt chunks this step may compute, as (request, tokens, tokens already computed or cached): the
        next chunk of each prompt under way, and of the first waiting requests seats are free for, in the order
        `_admit` takes them (at most `max_num_partial_prefills`; the request `_rebalance` took a seat for first);
        none whose chunk the free KV blocks do not hold."""
        prompts = []
        for req in self.running:
            if req.status is Status.RUNNING and req.is_prefilling:
                n = self._next_chunk(req, req.num_computed_tokens)
                if self.bm.can_allocate(req, n):
                    prompts.append((req, n, req.num_computed_tokens))
        # NOTE: a step starts at most max_num_partial_prefills prompts it does not finish, so no more are looked up in
        # the prefix cache (a queue of long prompts, under a target that admits a block a step, would cost as many
        # lookups a step as there are free seats)
        held = self._held()
        looks = min(max(self.config.max_num_seqs - len(self.running), held is not None),
                    self.config.max_num_partial_prefills)
        if looks <= 0:
            return prompts
        order = self._admission_order(self._seats())
        for req in order if held is None else chain([held], (r for r in order if r is not held)):
            if looks <= 0 or req.num_placeholders or not self._may_admit(req):
                break  # (where `_admit` stops too)
            if req.matcher is not None and req.waits_for_mask:
                continue
            cached = self._cached(req)
            context = len(cached) * self.bm.block_size
            n = self._next_chunk(req, context)
            if not self.bm.can_allocate(req, n, cached):
                break
            prompts.append((req, n, context))
            looks -= 1
        return prompts

    def _schedule_drafts(self, batch: Batch, first: int, budget: int, graphs: StepGraphs | None) -> int:
        """Speculative decoding (engine/spec.py): the decodes batch[first:] each add their draft, from the budget and
        the blocks every decode left: a draft never preempts anyone, nor takes a decode's place."""
        proposed = []
        for i in range(first, len(batch)):
            req = batch.reqs[i]
            if req.status is not Status.RUNNING:
                continue  # preempted by a later decode of this step (never: those take only younger ones; kept safe)
            draft = self.spec.draft(req)
            if draft:
                proposed.append((i, draft))
        allowed = self.spec.allow(len(batch) - first, [len(d) for _, d in proposed],
                                  self._catchup([batch.reqs[i] for i, _ in proposed]), graphs)
        for (i, draft), n in zip(proposed, allowed):
            req, draft = batch.reqs[i], draft[:n]
            if draft and len(draft) <= budget and self.bm.allocate(req, 1 + len(draft)):
                req.draft = draft
                batch.num_new_tokens[i] += len(draft)
                budget -= len(draft)
        return budget

    def _catchup(self, reqs: list[Request]) -> int:
        """Tokens the draft model must compute before these requests draft (0 with prompt lookup)."""
        return 0 if self.spec.lookup else sum(r.num_tokens - r.num_draft_computed for r in reqs)

    def _schedule_partial_prefills(self, batch: Batch, budget: int, cut: list[tuple[Request, int]]) -> int:
        """The next chunks of the prompts under way, in admission order, each leaving the tokens other clients'
        shares hold (`prompt_reserve`; those cut for them, with the chunk they wanted, go in `cut`); returns the budget
        left for `_admit`."""
        partial, reserve = 0, self.prompt_reserve
        for req in list(self.running):
            if partial >= self.config.max_num_partial_prefills or budget <= 0 or len(batch) >= self.config.max_num_seqs:
                break
            if req.status is not Status.RUNNING or not req.is_prefilling:
                continue  # preempted meanwhile, or decoding
            mine = reserve.get(req.client, 0)
            others = sum(reserve.values()) - mine
            want = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_limit(req))
            n = min(want, budget - others)
            if n < want:
                cut.append((req, want))
            if n <= 0:
                continue  # (its prompt's logprobs: this step has rows for no more; or the rest is others' share)
            if self._allocate_or_preempt(req, n, batch):
                self._add(batch, req, n)
                budget -= n
                partial += 1
                if mine:
                    reserve[req.client] = max(0, mine - n)
        return budget

    def _top_up(self, batch: Batch, cut: list[tuple[Request, int]], budget: int) -> None:
        """After `_admit`: the `budget` it left (a reserve for a prompt it passed over: the partial-prefill limit, its
        next block another prompt's in this step, no blocks, no rows for its logprobs) goes back to the prompts under
        way that others' reserves cut, up to the chunk each wanted, preempting no one; so a reserve its client cannot
        use does not hold back the prompts it cut."""
        admitted = set(batch.admitted)
        partial = sum(1 for r in batch.reqs if r.is_prefilling and r not in admitted)
        for req, want in cut:
            if budget <= 0:
                return
            if req.status is not Status.RUNNING:
                continue  # (preempted by a later request of this step)
            i = batch.reqs.index(req) if req in batch else None
            have = 0 if i is None else batch.num_new_tokens[i]
            n = min(want - have, budget, self._chunk_limit(req))  # (its prompt's logprobs: the rows left)
            if n <= 0 or (i is None and (len(batch) >= self.config.max_num_seqs
                                         or partial >= self.config.max_num_partial_prefills)):
                continue
            if not self.bm.allocate(req, have + n):
                continue
            self._add(batch, req, n)
            partial += i is None
            budget -= n

    def _admit(self, batch: Batch, budget: int, chunked: bool) -> int:
        """Admits waiting requests first-come-first-served; returns how many were admitted. Under `mixed`, a prompt
        whose next uncached block another prompt computes in this step is passed over (it keeps its place): next
        step that block is cached (under async scheduling, where a step's blocks are published a step later, it is
        computed again then: the wait keeps the steps the plain loop's)."""
        cfg, admitted, bs = self.config, 0, self.bm.block_size
        scheduled = {id(r): n for r, n in zip(batch.reqs, batch.num_new_tokens)}
        # prompts left mid-prefill by this step: at most max_num_partial_prefills; one it finishes does not count
        partial = sum(1 for r in self.running if r.status is Status.RUNNING and r.is_prefilling
                      and r.num_computed_tokens + scheduled.get(id(r), 0) < r.num_tokens)

        def fresh(r: Request, n: int) -> list[int]:
            """The hashes of the full prompt blocks `r`'s next `n` tokens complete that are not cached yet."""
            c = r.num_computed_tokens
            return [h for h in r.block_hashes[c // bs : (c + n) // bs] if h not in self.bm.cached]

        # the full prompt blocks this step computes, by hash (docs/architecture.md §4)
        computing = set() if not chunked else {
            h for r, n in zip(batch.reqs, batch.num_new_tokens) if r.is_prefilling for h in fresh(r, n)}
        if budget <= 0 or len(self.running) >= cfg.max_num_seqs or len(batch) >= cfg.max_num_seqs:
            return 0  # (before ordering the queue: no seat, or no room)
        seats = self._seats()
        held = self._held()
        for req in self._admission_order(seats):
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs or len(batch) >= cfg.max_num_seqs:
                break
            if held is not None and req is not held and len(self.running) + 1 >= cfg.max_num_seqs:
                continue  # (the last seat is the one taken for `held`)
            if req.num_placeholders:
                break  # preempted while its token was being sampled (async scheduling): back once it is known
            if req.matcher is not None and req.waits_for_mask:
                continue  # preempted while its grammar's next mask is being made: back once it is ready
            cached = self._cached(req)
            if computing and len(cached) < min(len(req.block_hashes), (req.num_tokens - 1) // bs) \
                    and req.block_hashes[len(cached)] in computing:
                continue  # its next block is another prompt's in this step: cached next step (those behind go on)
            remaining = req.num_tokens - len(cached) * bs
            n = min(remaining, budget, self._chunk_limit(req)) if chunked else remaining
            if n <= 0 or (req.wants_prompt_logprobs and n > self.prompt_rows):
                continue  # (its prompt's logprobs: this step has rows for no more; a whole prompt waits for a step)
            if chunked and n < remaining and partial >= cfg.max_num_partial_prefills:
                break  # (first come, first served: no later prompt goes ahead of it)
            if n > budget:
                break  # an unchunked prompt waits for a step of its own
            if not self._may_admit(req):
                break
            if not self.bm.allocate(req, n, cached):
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            self._add(batch, req, n)
            batch.admitted.append(req)
            if req is held:
                held = self.granted = None
            budget -= n
            admitted += 1
            partial += n < remaining
            if chunked:
                computing.update(fresh(req, n))  # (its cached tokens count as computed now)
        return admitted

    def _seats(self) -> Counter[Hashable] | None:
        """Running requests per client; None while every unfinished request is one client's (nothing to share)."""
        return Counter(r.client for r in self.running) if len(self.clients) > 1 else None

    def _admission_order(self, seats: Counter[Hashable] | None) -> list[Request]:
        """`waiting` in the order `_admit` takes it: as queued with one client; with more, each client's k-th
        waiting request (its own in queue order) ranked by the seats its client would then hold, `seats[client] + k`,
        ties in queue order. The preempted, at the front, stay first among their client's."""
        if seats is None:
            return list(self.waiting)
        ahead: Counter[Hashable] = Counter()
        ranked = []
        for i, req in enumerate(self.waiting):
            ranked.append((seats[req.client] + ahead[req.client], i, req))
            ahead[req.client] += 1
        ranked.sort(key=lambda x: x[:2])
        return [req for _, _, req in ranked]

    def _rebalance(self) -> None:
        """`mixed`, before a step: a waiting request whose turn it is (`_next_turn`) takes a seat from a client that
        holds two or more more than its client: that client's most recently admitted running request is preempted
        (requeued at the front: its client's next), and the seat is held for the request (`granted`) until it is
        admitted, so the seat is taken once, never traded back and forth. Under `normal`, while every seat is taken
        or the free KV blocks do not hold the request's first chunk (beside its prefix cache hits); under KV pressure
        (`hold`, `static`), for a client with nothing running only, one running request for the one admitted past the
        mode (`_may_admit`), so the pressure stays what it was. Not KV pressure: counted in `num_fair_preemptions`."""
        cfg = self.config
        pressure = self.pressure.mode != "normal"
        if len(self.clients) < 2 or not self.waiting or self._held() is not None or (
                not pressure and len(self.running) < cfg.max_num_seqs
                and self.bm.num_free_blocks >= self.bm.blocks_needed(cfg.max_num_batched_tokens)):
            return  # (one client; a seat already held; or room for any request's first chunk)
        seats = self._seats()
        assert seats is not None
        req = self._next_turn(seats)
        if req is None or not seats or (pressure and seats[req.client]):
            return
        cached = self._cached(req)  # (its first chunk takes blocks for what the prefix cache does not hold)
        first_chunk = self._next_chunk(req, len(cached) * self.bm.block_size)
        while pressure or len(self.running) >= cfg.max_num_seqs or not self.bm.can_allocate(req, first_chunk, cached):
            client, most = seats.most_common(1)[0]
            if most < seats[req.client] + 2:
                return
            victim = next(r for r in reversed(self.running) if r.client == client)
            self._preempt(victim, fair=True)
            seats[client] -= 1
            self.granted = req
            if pressure:
                return

    def _held(self) -> Request | None:
        """`granted`, while it waits (admitted, it is let go; finished, forgotten)."""
        if self.granted is not None and self.granted.status is not Status.WAITING:
            self.granted = None
        return self.granted

    def _next_turn(self, seats: Counter[Hashable]) -> Request | None:
        """The waiting request `_admission_order` puts first, of those that may be admitted now: the first waiting
        request of the client with the fewest seats (ties: the one queued first)."""
        best, fewest, seen = None, 0, set()
        for req in self.waiting:
            if req.client in seen:
                continue
            seen.add(req.client)
            if req.num_placeholders or (req.matcher is not None and req.waits_for_mask):
                continue  # (back once its token, or its grammar's mask, is known)
            if best is None or seats[req.client] < fewest:
                best, fewest = req, seats[req.client]
                if not fewest:
                    break
        return best

    def _cached(self, req: Request) -> PrefixHits:
        """The prefix cache's blocks for a waiting request's prompt; none where it wants its prompt's logprobs (they
        need every prompt token computed; its blocks are hashed all the same, for the prompts that share them)."""
        hits = self.bm.match_prefix(req)
        return PrefixHits() if req.wants_prompt_logprobs else hits

    def _chunk_limit(self, req: Request) -> int:
        """The most tokens of `req`'s prompt one chunk computes: with prompt logprobs, the rows of logits this step
        has left for them (`prompt_logprob_rows` in all)."""
        return min(self.config.chunk_limit, self.prompt_rows) if req.wants_prompt_logprobs else self.config.chunk_limit

    def _next_chunk(self, req: Request, computed: int) -> int:
        """The tokens of `req`'s prompt its next chunk computes after `computed` (computed or cached), with the step's
        whole budget (`_chunk_limit` is never above `max_num_batched_tokens`)."""
        return min(req.num_tokens - computed, self._chunk_limit(req))

    def _add(self, batch: Batch, req: Request, n: int) -> None:
        """`n` of `req`'s prompt tokens into `batch` (more of them where it is in already: `_top_up`)."""
        if req in batch:
            batch.num_new_tokens[batch.reqs.index(req)] += n
        else:
            batch.add(req, n)
        if req.wants_prompt_logprobs:
            self.prompt_rows -= n

    def _may_admit(self, req: Request) -> bool:
        """The pressure mode's gate for the head of `waiting`. `normal`: its next chunk fits (the caller checks).
        `hold`: all of its tokens fit beside a block of growth for each running request, so its prompt is not
        started only to be preempted a few steps later (preempted requests wait at the front: they come back
        first). `static`: nothing. An empty running set always admits, so nothing waits forever; nor does a client
        behind another's requests: the request `_rebalance` took a seat for is admitted in any mode."""
        mode = self.pressure.mode
        if mode == "normal" or not self.running or req is self.granted:
            return True
        if mode == "static":
            return False
        return self.bm.blocks_needed(req.num_tokens) + len(self.running) <= self.bm.num_free_blocks

    def _allocate_or_preempt(self, req: Request, n: int, batch: Batch) -> bool:
        """Allocates for `req`, preempting later-admitted, unscheduled requests while needed."""
        while not self.bm.allocate(req, n):
            victim = self._victim(req, batch)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _victim(self, req: Request, batch: Batch) -> Request | None:
        """The running request outside `batch` to preempt for `req`'s blocks. With one client, the most recently
        admitted, if it was admitted after `req` (never an older request for a younger one). With more, the most
        recently admitted request of the client holding the most seats among those a client may take from: a request
        admitted after `req` whose client holds as many seats as `req`'s or more, and any request of a client holding
        two or more more (as in `_rebalance`; either way the victim's client is left at most one seat short of
        `req`'s, so it never takes the block back). So one client's many streams grow into each other's blocks, not
        another client's few."""
        seats = self._seats() or Counter()  # (one client: all alike, so only a request admitted after `req`)
        mine, best, after = seats[req.client], None, True
        for r in reversed(self.running):
            if r is req:
                after = False
            elif r not in batch and (seats[r.client] >= mine + 2 or (after and seats[r.client] >= mine)):
                if best is None or seats[r.client] > seats[best.client]:
                    best = r
        return best

    def unadmit(self, batch: Batch) -> None:
        """Puts the requests `batch` admitted back at the front of the waiting queue, in their order, their blocks
        freed: the step was dropped before it computed anything (async scheduling), and the policies that never
        chunk schedule a prompt only on admission."""
        for req in reversed(batch.admitted):
            if req.status is Status.RUNNING:
                self.running.remove(req)
                self.bm.free(req)
                req.status = Status.WAITING
                self.waiting.appendleft(req)

    def _preempt(self, req: Request, fair: bool = False) -> None:
        req.draft = []
        self.running.remove(req)
        self.bm.free(req)
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        if fair:
            self.num_fair_preemptions += 1
        else:
            self.num_preemptions += 1

    # -- after the step --------------------------------------------------------------------

    def postprocess(self, batch: Batch) -> None:
        """Commits the step's tokens but draft tokens (the engine commits those verification kept); not for a
        request that ended while the step ran (the engine's `async_output_proc`), or was preempted (a failed step
        run again under async scheduling)."""
        for req, n in zip(batch.reqs, batch.num_new_tokens):
            if req.status is Status.RUNNING:
                self.bm.commit(req, n - len(req.draft))

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.bm.free(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if req.status is not Status.FINISHED:
            self.clients[req.client] -= 1
            if not self.clients[req.client]:
                del self.clients[req.client]
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.mask is not None:
            req.mask.cancel()  # (its grammar's next mask, if still queued: never made, others' go first)
        if not self.has_unfinished():
            self.pressure.settle()


def decode_shares(demands: dict[Hashable, int], capacity: int, turn: int = 0) -> dict[Hashable, int] | None:
    """A max-min fair split of `capacity` decodes between clients that want `demands[client]` each: a client wanting
    no more than an equal split of what the smaller ones leave gets all it wants, the others split the rest equally
    (what does not split evenly, one more each to as many of them, from the `turn`-th on: a caller that counts its
    steps hands the extra decodes round). None where all of it fits, or where a split would leave no client all it
    wants (every stream would be slower than the target either way)."""
    if sum(demands.values()) <= capacity:
        return None
    order = sorted(demands, key=demands.__getitem__)  # (stable: ties in `demands`' order)
    left = capacity
    served = 0
    while demands[order[served]] * (len(order) - served) <= left:  # (ends: not everything fits)
        left -= demands[order[served]]
        served += 1
    if not served:
        return None
    shares = {client: demands[client] for client in order[:served]}
    over = order[served:]
    share, extra = divmod(left, len(over))  # share >= the largest demand served: every client decodes at least one
    for i, client in enumerate(over):
        shares[client] = share + ((i - turn) % len(over) < extra)
    return shares


PROMPT_LOGPROBS_BYTES = 256 << 20  # a step's logits for prompt logprobs, in fp32


def prompt_logprob_rows(vocab_size: int) -> int:
    """Prompt tokens a step computes the logprobs of (the policies that never chunk: in prompts this short)."""
    return max(256, PROMPT_LOGPROBS_BYTES // (4 * max(vocab_size, 1)))
