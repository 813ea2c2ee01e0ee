"""What an engine step costs, learned from the steps the engine runs: `StepCost` sizes a step's prompt tokens to an
inter-token latency target (`EngineConfig.itl_slo_ms`, docs/architecture.md §4) and tells speculative decoding
(engine/spec.py) what a plain step costs; `LinearFit` is the fit behind it, and behind what drafts add to a step.

A running stream gets one token per step, so its inter-token latency is the step's time. The model:
`seconds = c0 + c1 * decodes + c2 * prompt_tokens + c3 * attention + c4 * eager`, where `attention` is the work of
the prompt chunks' attention, each chunk of n tokens after c computed ones adding n * (c + n / 2) (in millions): a
chunk deep in a long prompt costs more than the first; and `eager` is 1 for a step that runs eagerly while CUDA graphs
replay the others (engine/cuda_graphs.py: under `cudagraph_mode="full_decode_only"` every step with more tokens
than sequences, under `full` one too large for any bucket), whose kernels are launched one by one from Python: on a
GPU that adds more time than the tokens do. Without graphs it is always 0 (and so is c4). Fitted by least squares
with no coefficient below zero (`nonnegative_solve`) over the steps seen, older steps weighing less (`decay` per
step), so a change of load or of machine speed is followed within a few dozen steps.
"""
from __future__ import annotations

import math

import numpy as np

MIN_STEPS = 8  # steps observed before the model is trusted; until then the configured budget stands
HEADROOM = 0.8  # aim a step at this fraction of the target: step times scatter around the fit, and p99 counts


def attention_work(num_new_tokens: int, num_computed_tokens: int) -> float:
    return num_new_tokens * (num_computed_tokens + num_new_tokens / 2) / 1e6


def nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The least-squares coefficients x >= 0 from the normal equations `a x = b` (a = X^T X, b = X^T y): Lawson and
    Hanson's active set. Where the unconstrained solution has a term below zero (terms that moved together in the
    steps seen: a crowd admitted a block of prompt a step, its decodes growing with the chunks), zeroing it alone
    leaves the other terms fitted beside it, and far from the steps seen (tests/engine/test_step_cost.py: 32% off);
    here the others are fitted again without it."""
    n = len(b)
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)  # the terms not held at zero
    tol = 1e-9 * max(float(np.abs(b).max()), 1e-300)
    for _ in range(3 * n):  # (each pass frees a term; n of them at most, and as many held back)
        gain = b - a @ x  # (minus the gradient: a term held at zero whose gain is positive lowers the error)
        candidates = np.flatnonzero(~free & (gain > tol))
        if not len(candidates):
            break
        free[candidates[np.argmax(gain[candidates])]] = True
        while True:
            idx = np.flatnonzero(free)
            s = np.zeros(n)
            s[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if (s[idx] > 0).all():
                x = s
                break
            # the way from x to s leaves the feasible set: go as far as it allows, and hold the term that hits zero
            out = idx[s[idx] <= 0]
            gap = x[out] - s[out]  # (>= 0: x >= 0 >= s there)
            steps = np.divide(x[out], gap, out=np.zeros_like(gap), where=gap > 0)
            x = x + steps.min() * (s - x)
            free[out[steps.argmin()]] = False  # (held by name too: rounding may leave it a hair above zero)
            free &= x > 0
            x[~free] = 0.0
            if not free.any():
                break
    return x


class LinearFit:
    """`seconds = coef @ x` by least squares over the observations, each older one weighing `decay` times less; no
    coefficient below zero. `coef` is None until `min_steps` observations."""

    def __init__(self, n: int, decay: float = 0.97, ridge: float = 1e-6, min_steps: int = MIN_STEPS) -> None:
        self.decay, self.min_steps = decay, min_steps
        self._ridge = np.eye(n) * ridge  # NOTE: added at every solve, never decayed: a term no observation has varied
        # yet (decode-only steps have no prompt tokens) stays solvable, at zero
        self._xtx = np.zeros((n, n))  # weighted sums of x x^T and x y
        self._xty = np.zeros(n)
        self.steps = 0
        self.coef: np.ndarray | None = None

    def add(self, x: np.ndarray, seconds: float) -> None:
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self.steps += 1
        if self.steps >= self.min_steps:
            # NOTE: steps that all had the same mix cannot tell the terms apart yet, and then a zero keeps the
            # budget from running away
            self.coef = nonnegative_solve(self._xtx + self._ridge, self._xty)

    def at(self, x: np.ndarray) -> float | None:
        """The fitted seconds for `x`, or None before `min_steps` observations."""
        return None if self.coef is None else float(self.coef @ x)


class StepCost(LinearFit):
    def __init__(self, decay: float = 0.97, ridge: float = 1e-6) -> None:
        super().__init__(5, decay, ridge)  # x = (1, decodes, prompt tokens, attention, eager)

    def observe(self, decodes: int, prompt_tokens: int, attention: float, eager: bool, seconds: float) -> None:
        self.add(np.array([1.0, decodes, prompt_tokens, attention, float(eager)]), seconds)

    def predict(self, decodes: int, prompt_tokens: int, attention: float, eager: bool = False) -> float | None:
        return self.at(np.array([1.0, decodes, prompt_tokens, attention, float(eager)]))

    def prompt_budget(self, decodes: int, context: int, target_s: float, floor: int, cap: int,
                      extra_s: float = 0.0, eager_from: int | None = None) -> int:
        """Most prompt tokens a step with `decodes` decodes (and `extra_s` seconds of drafts) may add, as one chunk
        after `context` computed tokens, and still take at most HEADROOM * `target_s`; within [floor, cap]:
        prompts always advance, and never by more than the configured budget. `eager_from`: with CUDA graphs, the
        fewest prompt tokens that make this step run eagerly (`StepGraphs.eager_from`); None without graphs."""
        if self.coef is None:
            return cap
        c0, c1, _, _, c4 = self.coef
        room = HEADROOM * target_s - c0 - c1 * decodes - extra_s
        n = self._tokens(room, context)
        if eager_from is not None:  # the most a graphed step takes, or more where an eager one still fits
            eager = self._tokens(room - c4, context)
            n = max(min(n, eager_from - 1), eager if eager >= eager_from else -1)
        return int(min(cap, max(floor, n)))

    def decodes_within(self, target_s: float) -> float | None:
        """The most decodes a step of decodes alone may hold and still take at most HEADROOM * `target_s` (infinite
        while decodes cost nothing apart; 0 where not even the step's fixed cost fits); None before the fit."""
        if self.coef is None:
            return None
        c0, c1 = self.coef[0], self.coef[1]
        room = HEADROOM * target_s - c0
        if room <= 0:
            return 0.0
        return room / c1 if c1 > 0 else math.inf

    def decodes_for(self, tokens: int, context: int) -> float:
        """How many decodes take the time of a prompt chunk of `tokens` after `context` computed ones (the unit of
        `decodes_within`); after the fit, while decodes cost something."""
        c1, c2, c3 = self.coef[1:4]
        return (c2 * tokens + c3 * attention_work(tokens, context)) / c1

    def tokens_for(self, decodes: float, context: int) -> int:
        """The most prompt tokens, as one chunk after `context` computed ones, that take no more than the time of
        `decodes` decodes (the inverse of `decodes_for`)."""
        return int(min(self._tokens(decodes * self.coef[1], context), 1 << 30))

    def _tokens(self, room: float, context: int) -> float:
        """The most prompt tokens, as one chunk after `context` computed ones, whose cost fits in `room` seconds
        (0 where none does; infinite where they cost nothing)."""
        if room <= 0:
            return 0.0
        c2, c3 = self.coef[2], self.coef[3]
        # c2 n + c3 n (context + n / 2) / 1e6 <= room: the positive root of a quadratic in n
        a, b = c3 / 2e6, c2 + c3 * context / 1e6
        if a > 0:
            return (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
        if b > 0:
            return room / b
        return math.inf
