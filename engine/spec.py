"""Speculative decoding by prompt lookup (`EngineConfig.speculative = "ngram"`).

A decoding request whose last tokens occurred earlier in its own context (its prompt, earlier turns, a prefix-cached
system prompt, its own output) proposes the tokens that followed them there: its `draft`. The step then computes
1 + len(draft) tokens for it, exactly as a chunk of prompt is computed, and the sampler verifies them
(`Sampler.verify`): greedy keeps the drafts that equal the argmax; sampling keeps draft x with probability p(x)
under the request's filtered distribution p (the proposal is a point mass, so this is the standard rejection rule)
and on a rejection draws from p without x. The output therefore has the distribution of ordinary decoding, and
greedy output its exact tokens. A step yields 1 + (drafts accepted) tokens; only their KV is committed, and blocks
that held only rejected drafts go back to the pool (`BlockManager.trim`).

It backs off (`Speculation`): a request proposes fewer tokens after rejections and none for a while after
proposals that all failed, and no request proposes in a step with `speculative_disable_by_batch_size` or more
decoding requests, where the extra tokens cost more than they save.
"""
from __future__ import annotations

import numpy as np

from engine.config import EngineConfig
from engine.request import Request

COOLDOWN_MAX = 32  # steps a request with nothing accepted waits before proposing again, at most


def propose(token_ids: list[int], k: int, nmin: int, nmax: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix (`nmax` tokens down to
    `nmin`) of `token_ids` that occurred before."""
    L = len(token_ids)
    if k <= 0 or L <= nmin:
        return []
    toks = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(nmax, L - 1), nmin - 1, -1):
        # windows starting at 0 .. L-n-1: every earlier occurrence, whose continuation starts inside the tokens
        windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)
        hits = np.flatnonzero((windows == toks[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start:start + k]
    return []


class Speculation:
    """Decides each decoding request's draft for a step and learns from what was accepted."""

    def __init__(self, config: EngineConfig, max_model_len: int):
        self.k = config.num_speculative_tokens
        self.nmin, self.nmax = config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max
        self.disable_at = config.speculative_disable_by_batch_size
        self.max_model_len = max_model_len
        self.lookup = config.draft_model is None  # else the runner's draft model fills each draft (`Speculation.draft`)
        self.num_draft_tokens = 0  # proposed and verified
        self.num_accepted_tokens = 0
        self.num_steps = 0  # requests' verification steps (with at least one draft token)

    def enabled_for(self, num_decodes: int) -> bool:
        return num_decodes < self.disable_at

    def draft(self, req: Request) -> list[int]:
        """The draft `req` proposes this step (maybe none)."""
        p = req.params
        if p.has_penalties:  # NOTE: penalties count outputs, and a draft position's would include the drafts before it
            return []
        if req.generator is not None and not p.greedy:
            # NOTE: verification draws other uniforms than plain sampling, and whether a request drafts depends on
            # the load: a seeded request's text must depend on its seed alone
            return []
        if req.spec_cooldown > 0:
            req.spec_cooldown -= 1
            return []
        # every token the step may yield must fit: max_tokens and the context
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        k = min(req.spec_k or self.k, room)
        if not self.lookup:  # its length only: the draft model writes the tokens before the step's forward
            return [-1] * max(k, 0)
        return propose(req.token_ids, k, self.nmin, self.nmax)

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        """`req` verified `proposed` draft tokens and kept `accepted`."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_steps += 1
        if accepted == proposed:  # all taken: propose more next time
            req.spec_k = min(self.k, (req.spec_k or self.k) + 1)
            req.spec_misses = 0
        elif accepted:
            req.spec_k = accepted + 1
            req.spec_misses = 0
        else:  # nothing: shorter drafts, and after repeated misses a pause that doubles each time
            req.spec_k = 1
            req.spec_misses += 1
            if req.spec_misses >= 2:
                req.spec_cooldown = min(COOLDOWN_MAX, 2 ** (req.spec_misses - 1))
