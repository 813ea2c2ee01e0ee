"""Turns last-token logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

All vocabulary work is batched tensor ops, and so are penalties and seeded draws. A seeded request draws from its
own counter-based stream (`SeededStream`), so its samples do not depend on what else is in the batch.

Sampling sorts nothing (`sample`): top-k is a partial top-k, min-p a comparison with the row's max, and the
nucleus (top-p) is found by rejection, as FlashInfer's sampling kernels do: draw from the allowed tokens by
inverse CDF, accept if the tokens more probable than the draw hold less than top_p, else draw again from
those only. `filter_logits` (a full sort) defines the same support: tests hold one to the other, and it
serves the rare row still drawing after `MAX_ROUNDS`.
"""
from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import torch

from engine.request import SAMPLING_EPS, Request, TokenLogprob
from engine.structured import Grammars


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place. Presence/frequency count generated tokens; repetition covers prompt + output (as vLLM).

    Batched and sparse: a penalty changes only the logits of tokens a row has seen, so the work is over those
    (row, token) pairs, never over the vocabulary: one gather and one scatter per kind of penalty, whatever the
    batch. Host work is one flat list of the penalized rows' output tokens; each prompt's distinct tokens go to the
    device once (`Request.prompt_tokens`). The arithmetic is the per-row formula's, element for element."""
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    dev, V, dt = logits.device, logits.shape[1], logits.dtype
    sub = [reqs[i] for i in rows]
    flat_logits = logits.view(-1)
    outs = [r.token_ids[r.num_prompt_tokens : r.num_tokens - r.num_placeholders] for r in sub]
    # each output token as an index into the flattened logits: its row * V + the token
    out_keys = (torch.tensor(list(chain.from_iterable(outs)), dtype=torch.long)
                + torch.repeat_interleave(torch.tensor(rows) * V, torch.tensor([len(o) for o in outs]))).to(dev)
    row_of = lambda keys: keys // V  # noqa: E731
    per_row = lambda name: torch.tensor([getattr(r.params, name) for r in reqs], dtype=dt, device=dev)  # noqa: E731
    if any(r.params.repetition_penalty != 1.0 for r in sub):
        for r in sub:
            if r.prompt_tokens is None or r.prompt_tokens.device != dev:
                r.prompt_tokens = torch.tensor(sorted(set(r.token_ids[: r.num_prompt_tokens])), dtype=torch.long,
                                               device=dev)
        prompts = [r.prompt_tokens for r in sub]
        prompt_keys = torch.cat(prompts) + torch.repeat_interleave(torch.tensor(rows, device=dev) * V,
                                                                   torch.tensor([len(p) for p in prompts], device=dev))
        seen = torch.cat([out_keys, prompt_keys])  # NOTE: a key seen twice is written twice, with the same value
        rep, x = per_row("repetition_penalty")[row_of(seen)], flat_logits[seen]
        # (clamped: a penalty near 0 divides a logit past the dtype's range, and inf logits make the softmax NaN;
        # low enough that the smallest temperature, which divides them next, keeps them finite)
        flat_logits[seen] = torch.where(x > 0, x / rep, x * rep).clamp_(max=torch.finfo(dt).max * SAMPLING_EPS / 2)
    if len(out_keys) and any(r.params.presence_penalty or r.params.frequency_penalty for r in sub):
        keys, counts = torch.unique(out_keys, return_counts=True)
        row = row_of(keys)
        flat_logits[keys] -= per_row("frequency_penalty")[row] * counts.to(dt) + per_row("presence_penalty")[row]


def apply_biases(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place: -inf outside a request's `allowed_token_ids`, its `logit_bias` added, while `min_tokens` holds it
    back, -inf on the tokens that would end it (EOS, stop_token_ids), and -inf on the token that would complete one
    of its `bad_words`. One masked fill for the rows with allowed ids,
    one scatter for the whole batch over the (row, token) pairs of the others; each request's go to the device once
    (`Request.allowed`, `Request.biases`, `Request.ban`), so a step's host work is a few ops per request that has any,
    whatever their size."""
    dev, V = logits.device, logits.shape[1]
    parts, rows, masked, masks = [], [], [], []
    for i, r in enumerate(reqs):
        if not r.params.adjusts_logits:
            continue
        if r.params.allowed_token_ids is not None:
            if r.allowed is None or r.allowed.device != dev:
                r.allowed = torch.ones(V, dtype=torch.bool, device=dev)
                r.allowed[torch.tensor(r.params.allowed_token_ids, device=dev)] = False  # (True: masked out)
            masked.append(i)
            masks.append(r.allowed)
        if r.params.logit_bias:
            r.biases = _pairs(r.biases, dev, r.params.logit_bias, r.params.logit_bias.values())
            parts.append(r.biases)
            rows.append(i)
        if r.min_tokens_banned is not None and r.below_min_tokens():
            r.ban = _pairs(r.ban, dev, r.min_tokens_banned)
            parts.append(r.ban)
            rows.append(i)
        if r.bad_tokens:
            r.bad_device = _pairs(r.bad_device, dev, r.bad_tokens)
            parts.append(r.bad_device)
            rows.append(i)
        if r.bad_sequences:  # its last token, where the output (not the placeholders of running steps) ends in the rest
            end = r.num_tokens - r.num_placeholders
            last = [s[-1] for s in r.bad_sequences
                    if len(s) - 1 <= end - r.num_prompt_tokens and r.token_ids[end - len(s) + 1 : end] == s[:-1]]
            if last:
                parts.append(_pairs(None, dev, last))
                rows.append(i)
    if parts:  # (accumulated: a token both biased and banned is -inf)
        keys = torch.cat([ids for ids, _ in parts]) + torch.repeat_interleave(
            torch.tensor(rows, device=dev) * V, torch.tensor([len(ids) for ids, _ in parts], device=dev))
        logits.view(-1).index_put_((keys,), torch.cat([v for _, v in parts]).to(logits.dtype), accumulate=True)
    if masked:
        at = torch.tensor(masked, device=dev)
        logits[at] = logits[at].masked_fill(torch.stack(masks), float("-inf"))


def _pairs(made: tuple[torch.Tensor, torch.Tensor] | None, dev: torch.device, ids: Iterable[int],
           values: Iterable[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, values) on `dev` for `apply_biases`' scatter: `made` if it is there already (a request's, made at
    its first step), else made now; values -inf when not given (the token is banned)."""
    if made is not None and made[0].device == dev:
        return made
    t = torch.tensor(list(ids), device=dev)
    return t, torch.full(t.shape, float("-inf"), device=dev) if values is None else torch.tensor(list(values), device=dev)


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    use_top_k_p: bool = True, use_min_p: bool = True,
) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k / nucleus / min-p set. logits: (N, V).

    The sets are by value, so tied tokens stay or go together (as `sample` draws): top-k keeps every token at least
    as likely as the k-th; the nucleus keeps a token when the tokens strictly more likely hold less than top_p.
    `use_*` let a caller that knows no row filters skip the work (and a device sync)."""
    V = logits.shape[1]
    if use_top_k_p and (bool((top_k > 0).any()) or bool((top_p < 1.0).any())):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, V).clamp(1, V)
        drop = sorted_logits < sorted_logits.gather(1, (k - 1)[:, None])
        probs = sorted_logits.softmax(-1)
        # a token is dropped when the tokens strictly more likely already cover top_p (a tied group: from its first)
        # NOTE: top_p == 1 must mean "off": a float32 cumsum reaches 1.0 before the tail ends.
        starts = torch.ones_like(sorted_logits, dtype=torch.bool)
        starts[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
        first = (torch.arange(V, device=logits.device) * starts).cummax(-1).values  # each token's tied group's start
        above = (probs.cumsum(-1) - probs).gather(1, first)
        drop |= (above >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if use_min_p and bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


MAX_ROUNDS = 8  # rejection rounds before a row falls back to the sorted filter


# SplitMix64's constants as signed int64 (torch has no uint64 arithmetic; products wrap the same)
_GAMMA, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's `>>` is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def hashed_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """U[0, 1) float32s, the `counters[i]`-th of stream `seeds[i]` (int64 tensors): SplitMix64's output for state
    seed + (counter + 1) * gamma, its top 24 bits. A counter-based generator: any draws of any streams in one batch
    of elementwise ops."""
    z = seeds + (counters + 1) * _GAMMA
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 40).to(torch.float32) * 2.0**-24


class SeededStream:
    """A seeded request's random numbers: its n-th uniform is `hashed_uniforms(seed, n)`, so the uniforms of every
    seeded request in a step come from one batched computation (no kernel, no generator per request), and what
    it draws depends on its seed alone, never on its batch. `get_state` / `set_state` as a torch.Generator's, but
    the state is a `(seed, counter)` tuple, not a tensor (one is taken per seeded request per step, and crosses to
    an engine process's server in every delivery: a tensor pickles in ~130 us): what the engine saves before a step
    and puts back for a retry, and what a `Checkpoint` carries."""

    def __init__(self, seed: int):
        self.seed, self.counter = seed, 0

    def get_state(self) -> tuple[int, int]:
        return self.seed, self.counter

    def set_state(self, state: tuple[int, int]) -> None:
        self.seed, self.counter = state

    def rand(self, n: int, device: torch.device) -> torch.Tensor:
        """Its next n uniforms."""
        start, self.counter = self.counter, self.counter + n
        return hashed_uniforms(torch.full((n,), self.seed, dtype=torch.long, device=device),
                               torch.arange(start, start + n, device=device))


def _uniforms(gens: list[SeededStream | None], default: torch.Generator, device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: a seeded row's from its own stream (all of them in one batch), every other row's from
    one call on `default`."""
    u = torch.empty(len(gens), device=device)
    rest = [j for j, g in enumerate(gens) if g is None]
    if rest:
        u[rest] = torch.rand(len(rest), generator=default, device=device)
    seeded = [j for j, g in enumerate(gens) if g is not None]
    if seeded:
        streams = [gens[j] for j in seeded]
        counters = [g.counter for g in streams]
        for g in streams:
            g.counter += 1
        u[seeded] = hashed_uniforms(torch.tensor([g.seed for g in streams], device=device),
                                    torch.tensor(counters, device=device))
    return u


def _rand(n: int, gen: SeededStream | None, default: torch.Generator, device: torch.device) -> torch.Tensor:
    """n uniforms of one request: from its stream, or the engine's generator."""
    return gen.rand(n, device) if gen is not None else torch.rand(n, generator=default, device=device)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token per row, drawn with probability proportional to `weights` (>= 0, some > 0), for uniforms `u`.
    NOTE: float64: a float32 running sum over a large vocabulary rounds the tail's small weights away."""
    cdf = weights.double().cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(
        max=weights.shape[1] - 1)


def sample(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           gens: list[SeededStream | None], default: torch.Generator, max_top_k: int | None = None,
           any_min_p: bool | None = None) -> torch.Tensor:
    """A token per row of `probs` [R, V], drawn from it restricted to `filter_logits`' support: the row's top_k
    (0: all), its nucleus of mass top_p (1.0: all; measured on the whole distribution) and its min_p set.
    `max_top_k` (the largest top_k, 0: none) and `any_min_p`, when the caller knows them, save device syncs."""
    R, V = probs.shape
    allowed = torch.ones_like(probs, dtype=torch.bool)
    kmax = int(top_k.max()) if max_top_k is None else max_top_k
    if kmax > 0:
        kth = probs.topk(min(kmax, V), dim=-1).values  # [R, kmax], descending
        kth = kth.gather(1, (top_k.clamp(1, V) - 1)[:, None])
        allowed &= (probs >= kth) | (top_k <= 0)[:, None]
    if bool((min_p > 0).any()) if any_min_p is None else any_min_p:
        allowed &= probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
    weights = probs * allowed
    out = torch.empty(R, dtype=torch.long, device=probs.device)
    todo, rows = torch.arange(R, device=probs.device), list(range(R))
    for _ in range(MAX_ROUNDS):
        w, p = weights[todo], probs[todo]
        x = _inverse_cdf(w, _uniforms([gens[i] for i in rows], default, probs.device))
        px = p.gather(1, x[:, None])  # [n, 1]
        # in the nucleus: the tokens more probable than x hold less than top_p (the best token always is)
        ok = ((p * (p > px)).sum(-1) < top_p[todo]) | (top_p[todo] >= 1.0)
        ok &= w.gather(1, x[:, None]).squeeze(1) > 0
        out[todo[ok]] = x[ok]
        if bool(ok.all()):
            return out
        # x is outside the nucleus: every nucleus token is more probable than x; draw again from those
        bad = ~ok
        weights[todo[bad]] = w[bad] * (p[bad] > px[bad])
        todo = todo[bad]
        rows = todo.tolist()
    # the last few: the sorted filter, then one draw
    kept = filter_logits(probs[todo].log(), top_k[todo], top_p[todo], min_p[todo]).softmax(-1)
    out[todo] = _inverse_cdf(kept, _uniforms([gens[i] for i in rows], default, probs.device))
    return out


def draw(logits: torch.Tensor, params: list, gens: list[SeededStream | None],
         default: torch.Generator) -> torch.Tensor:
    """A token per row of `logits` [R, V] under its request's temperature, top-k, top-p and min-p (`sample`)."""
    dev, V = logits.device, logits.shape[1]
    probs = (logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]).softmax(-1)
    return sample(probs, torch.tensor([min(p.top_k, V) for p in params], device=dev),
                  torch.tensor([p.top_p for p in params], device=dev), torch.tensor([p.min_p for p in params], device=dev),
                  gens, default, max_top_k=max(min(p.top_k, V) for p in params),
                  any_min_p=any(p.min_p > 0 for p in params))


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.last: torch.Tensor | None = None  # the last call's tokens, on the device
        self.grammars: Grammars | None = None  # structured output's compiler, made by the engine at first use

    def make_generator(self, seed: int) -> SeededStream:
        return SeededStream(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: (N, V) float32, one row per request in `reqs`. Returns token ids and logprobs."""
        logits = logits.float()
        raw = logits  # (logprobs are the model's: before penalties, biases, bans and temperature)
        if any(r.params.adjusts_logits for r in reqs):
            logits = logits.clone(memory_format=torch.contiguous_format)  # (they work on its flat view)
            apply_penalties(logits, reqs)
            apply_biases(logits, reqs)
            if rows := [i for i, r in enumerate(reqs) if r.matcher is not None]:
                assert self.grammars is not None
                self.grammars.apply(logits, rows, [reqs[i] for i in rows])
        greedy_tokens = logits.argmax(-1)
        tokens = greedy_tokens.clone()
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            params = [reqs[i].params for i in rand]
            tokens[rand] = draw(logits[rand], params, [reqs[i].generator for i in rand], self.generator)
        self.last = tokens  # (async scheduling: the next step's inputs, read on the device)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            for i, lp in zip(want, token_logprobs(raw[want], [token_list[i] for i in want],
                                                  [reqs[i].params.logprobs for i in want])):
                logprobs[i] = lp
        return token_list, logprobs

    def verify(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """Speculative decoding's verification (engine/spec.py). logits: each request's rows in order: 1 +
        len(r.draft) of them, the last the usual next-token row and each one before it the row that predicts a draft
        token. Returns each request's new tokens (the draft tokens kept, then one drawn at the first rejection or
        after the last draft token) and their logprobs if it asked for them. A request without a draft samples as
        `__call__` does. Requests with a draft have no penalties, no logit bias, no allowed_token_ids, no bad_words, no
        structured output and no tokens banned by min_tokens (engine/spec.py never drafts for them)."""
        logits = logits.float()
        width = [1 + len(r.draft) for r in reqs]
        start = [0]
        for w in width[:-1]:
            start.append(start[-1] + w)
        tokens: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[TokenLogprob] | None] = [None] * len(reqs)
        plain = [j for j, r in enumerate(reqs) if not r.draft]
        if plain:
            t, lp = self(logits[[start[j] for j in plain]], [reqs[j] for j in plain])
            for j, tok, l in zip(plain, t, lp):
                tokens[j], logprobs[j] = [tok], None if l is None else [l]
        argmax = logits.argmax(-1).tolist()
        for j, r in enumerate(reqs):
            if not r.draft:
                continue
            s, d = start[j], r.draft
            if r.params.greedy:
                best = argmax[s : s + width[j]]
                a = 0
                while a < len(d) and d[a] == best[a]:
                    a += 1
                tokens[j] = best[: a + 1]
            else:
                tokens[j] = self._verify_sampled(logits[s : s + width[j]], r)
            if r.params.logprobs is not None:
                n = len(tokens[j])
                logprobs[j] = token_logprobs(logits[s : s + n], tokens[j], [r.params.logprobs] * n)
        return tokens, logprobs

    def _verify_sampled(self, rows: torch.Tensor, req: Request) -> list[int]:
        """The rejection rule for a point-mass proposal: draft token x at row i is kept with probability p_i(x),
        p_i the request's filtered distribution (`filter_logits`: the support `sample` draws from); at the first
        rejection a token is drawn from p_i without x, after the last draft token one from the last row's p."""
        p, (w, V), dev = req.params, rows.shape, rows.device
        probs = filter_logits(rows / p.temperature, torch.full((w,), min(p.top_k, V), device=dev),
                              torch.full((w,), p.top_p, device=dev), torch.full((w,), p.min_p, device=dev)).softmax(-1)
        gen = req.generator
        u = _rand(w - 1, gen, self.generator, dev).tolist()
        kept = probs[torch.arange(w - 1, device=dev), torch.tensor(req.draft, device=dev)].tolist()
        out: list[int] = []
        for i, x in enumerate(req.draft):
            if u[i] < kept[i]:
                out.append(x)
                continue
            rest = probs[i].clone()
            rest[x] = 0.0
            out.append(int(_inverse_cdf(rest[None], _rand(1, gen, self.generator, dev))[0]))
            return out
        out.append(int(_inverse_cdf(probs[-1:], _rand(1, gen, self.generator, dev))[0]))
        return out


def token_logprobs(raw: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """For each row of raw logits [R, V]: the logprob of its token and its `ks[i]` most likely tokens."""
    lp = raw.log_softmax(-1)
    top_v, top_i = lp.topk(max(max(ks), 1), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1).tolist()
    return [TokenLogprob(t, c, list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist())))
            for j, (t, c, k) in enumerate(zip(tokens, chosen, ks))]
