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
decoding requests. Below that, a step drafts only where it pays (`Speculation.allow`, `speculative_adaptive`): from
what the engine measured (a plain step's cost, engine/step_cost.py; what verified drafts add to a step; the draft
model's forwards and tokens) and the acceptance rate seen so far, it picks the draft length that yields the most
tokens per second, and
none where plain decoding yields more; after PROBE_EVERY declined steps one request drafts anyway, so both
estimates stay current.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.config import EngineConfig
from engine.request import Request
from engine.step_cost import LinearFit, StepCost

if TYPE_CHECKING:
    from engine.cuda_graphs import StepGraphs

COOLDOWN_MAX = 32  # steps a request with nothing accepted waits before proposing again, at most
PROBE_EVERY = 32  # steps the cost model declines drafting in a row before one drafts anyway, to measure again
ACCEPTANCE_DECAY = 0.998  # per verification: the acceptance rate follows the last several hundred


def expected_kept(alpha: float, k: int) -> float:
    """Draft tokens a k-token draft keeps on average if each is accepted with probability `alpha` (until the first
    rejection): alpha + alpha^2 + ... + alpha^k."""
    return k if alpha >= 1.0 else alpha * (1 - alpha**k) / (1 - alpha)


def propose(token_ids: list[int], k: int, nmin: int, nmax: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix (`nmax` tokens down to
    `nmin`) of `token_ids` that occurred before."""
    return _lookup(np.asarray(token_ids, dtype=np.int64), k, nmin, nmax)


def _lookup(toks: np.ndarray, k: int, nmin: int, nmax: int) -> list[int]:
    L = len(toks)
    if k <= 0 or L <= nmin:
        return []
    # an earlier occurrence of the suffix ends where the last token occurred before (one pass over the context);
    # the few candidates are then checked token by token, back from there
    ends = np.flatnonzero(toks[: L - 1] == toks[L - 1])
    for n in range(min(nmax, L - 1), nmin - 1, -1):
        c = ends[ends >= n - 1]  # room for n tokens ending there
        for i in range(1, n):
            c = c[toks[c - i] == toks[L - 1 - i]]
        if c.size:
            start = int(c[-1]) + 1
            return toks[start : start + k].tolist()
    return []


class _Tokens:
    """A request's tokens as a numpy array, grown as they are (appended to only), so that a lookup does not convert
    the whole context every step."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf, self.n = np.empty(64, dtype=np.int64), 0

    def of(self, token_ids: list[int]) -> np.ndarray:
        L = len(token_ids)
        if L > len(self.buf):
            grown = np.empty(max(L, 2 * len(self.buf)), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if L > self.n:
            self.buf[self.n : L] = token_ids[self.n :]
        self.n = L
        return self.buf[:L]


class Speculation:
    """Decides each decoding request's draft for a step and learns from what was accepted."""

    def __init__(self, config: EngineConfig, max_model_len: int, step_cost: StepCost | None = None):
        self.k = config.num_speculative_tokens
        self.nmin, self.nmax = config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max
        self.disable_at = config.speculative_disable_by_batch_size
        self.adaptive = config.speculative_adaptive
        self.max_model_len = max_model_len
        self.lookup = config.draft_model is None  # else the runner's draft model fills each draft (`Speculation.draft`)
        self.step_cost = step_cost or StepCost()  # the scheduler's: a plain step's time (steps without drafts)
        # fed by the engine (`observe_step`): what drafts add to a step's time beside the draft model, by (draft
        # tokens, drafting requests), the plain step's predicted time taken off; and the draft model's own time by
        # (forwards, tokens). A few steps tell two terms apart.
        self.verify_cost = LinearFit(2, min_steps=3)
        self.draft_cost = LinearFit(2, min_steps=3)
        self.num_draft_tokens = 0  # proposed and verified
        self.num_accepted_tokens = 0
        self.num_steps = 0  # requests' verification steps (with at least one draft token)
        self.num_declined = 0  # steps whose drafts the cost model declined
        self._kept = 1.0  # decayed draft tokens kept, and tried (kept, plus the rejection that ended a draft):
        self._tried = 2.0  # their ratio estimates a draft token's chance to be kept; a prior of 1/2
        self._declined_in_a_row = 0
        self._drafted_in_a_row = 0

    def enabled_for(self, num_decodes: int) -> bool:
        return num_decodes < self.disable_at

    def draft(self, req: Request) -> list[int]:
        """The draft `req` proposes this step (maybe none)."""
        p = req.params
        if p.has_penalties:  # NOTE: penalties count outputs, and a draft position's would include the drafts before it
            return []
        if p.logit_bias or p.allowed_token_ids is not None or p.structured_output is not None or p.bad_words:
            return []  # (verification takes the rows' own argmax: unbiased, unmasked)
        if req.min_tokens_banned is not None and req.below_min_tokens():  # (so would min_tokens' ban)
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
        if req.spec_tokens is None:
            req.spec_tokens = _Tokens()
        return _lookup(req.spec_tokens.of(req.token_ids), k, self.nmin, self.nmax)

    @property
    def acceptance(self) -> float:
        """The chance that a draft token is kept, given those before it were (decayed estimate)."""
        return self._kept / self._tried

    def seconds(self, drafts: list[int], catchup: int = 0) -> float | None:
        """Predicted time a step's drafts add (`drafts`: each drafting request's length; `catchup`: tokens the draft
        model must compute before drafting), or None while a model is not fitted yet."""
        extra = self.verify_cost.at(np.array([sum(drafts), len(drafts)], dtype=np.float64))
        if extra is None or not drafts or self.lookup:
            return extra
        # one forward for the catch-ups (yielding each first draft token), then one per further token
        model = self.draft_cost.at(np.array([max(drafts), catchup + sum(drafts) - len(drafts)], dtype=np.float64))
        return None if model is None else extra + model

    def observe_step(self, plain_s: float | None, seconds: float, drafts: int, requests: int, forwards: int = 0,
                     tokens: int = 0, draft_s: float = 0.0) -> None:
        """A step with `drafts` draft tokens of `requests` requests took `seconds` beside the draft model, which ran
        `forwards` forwards of `tokens` tokens in `draft_s`; `plain_s`: the plain step's predicted time."""
        if plain_s is not None:
            self.verify_cost.add(np.array([drafts, requests], dtype=np.float64), seconds - plain_s)
        if forwards:
            self.draft_cost.add(np.array([forwards, tokens], dtype=np.float64), draft_s)

    def _best(self, decodes: int, drafts: list[int], catchup: int, graphs: StepGraphs | None) -> int | None:
        """The draft length that yields the most tokens per second in a step with `decodes` decodes, each proposal
        (`drafts`) cut to it; 0 where plain decoding yields more; None while the cost models are not fitted.
        `graphs`: the runner's CUDA graphs, if any: a step none of them replays (drafts may make it one) costs
        the step-cost model's eager term more."""
        c = self.step_cost.coef
        if c is None:
            return None

        def step(draft_tokens: int) -> float:  # a step of these decodes and draft tokens, without what drafts add
            eager = graphs is not None and graphs.eager_from(decodes, draft_tokens) == 0
            return c[0] + c[1] * decodes + c[4] * eager

        plain = max(step(0), 1e-9)  # a decode-only step's time: `decodes` tokens
        best, best_rate = 0, decodes / plain
        for k in range(1, max(drafts, default=0) + 1):
            cut = [min(d, k) for d in drafts]
            extra = self.seconds(cut, catchup)
            if extra is None:
                return None
            rate = (decodes + sum(expected_kept(self.acceptance, d) for d in cut)) / max(step(sum(cut)) + extra, 1e-9)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _decline(self) -> bool:
        """Counts a declined step; True instead when a probe is due (PROBE_EVERY declined in a row; it stays due
        until a draft goes through)."""
        if self._declined_in_a_row >= PROBE_EVERY:  # measure again: the load, the text or the machine may have changed
            return True
        self._declined_in_a_row += 1
        self.num_declined += 1
        return False

    def may_pay(self, decodes: int, graphs: StepGraphs | None = None) -> bool:
        """Before any request proposes (a lookup costs time too): may a step with `decodes` decodes draft at all?
        Not before a plain step's cost is known (the steps without drafts teach it), nor once after PROBE_EVERY
        drafting steps in a row (to learn it again); not where drafts cannot pay even at best (every decode
        proposing the most, no catch-up), which counts as a declined step."""
        if not self.adaptive:
            return True
        if self.step_cost.coef is None or self._drafted_in_a_row >= PROBE_EVERY:
            self._drafted_in_a_row = 0
            return False
        return self._best(decodes, [self.k] * decodes, 0, graphs) != 0 or self._decline()

    def allow(self, decodes: int, drafts: list[int], catchup: int = 0, graphs: StepGraphs | None = None) -> list[int]:
        """How much of each proposal (`drafts`: each drafting request's length; `catchup`: their draft model's
        catch-up tokens) a step with `decodes` decodes verifies: all cut to the length that yields the most tokens
        per second by the cost models and the acceptance rate, or none where plain decoding yields more. Until
        what drafts cost is known, all of each; after PROBE_EVERY declined steps in a row, all of the first one (a
        probe: one request, so that it costs little in a large batch)."""
        if not self.adaptive or not drafts:
            return drafts
        best = self._best(decodes, drafts, catchup, graphs)
        if best is None or best:
            self._declined_in_a_row = 0
            self._drafted_in_a_row += 1
            return drafts if best is None else [min(d, best) for d in drafts]
        self._drafted_in_a_row = 0
        if self._decline():
            self._declined_in_a_row = 0
            return drafts[:1] + [0] * (len(drafts) - 1)
        return [0] * len(drafts)

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        """`req` verified `proposed` draft tokens and kept `accepted`."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_steps += 1
        self._kept = ACCEPTANCE_DECAY * self._kept + accepted
        self._tried = ACCEPTANCE_DECAY * self._tried + accepted + (accepted < proposed)
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
