"""Turns last-token logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

All vocabulary work is batched tensor ops; Python loops run over requests only. A seeded request
draws from its own generator, so its samples do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from engine.request import Request, TokenLogprob


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place. Presence/frequency count generated tokens; repetition covers prompt + output (as vLLM)."""
    V = logits.shape[1]
    for i, r in enumerate(reqs):
        p = r.params
        if not p.has_penalties:
            continue
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(r.token_ids, dtype=torch.long, device=logits.device)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if out.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out, minlength=V)[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    use_top_k_p: bool = True, use_min_p: bool = True,
) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k / nucleus / min-p set. logits: (N, V).

    `use_*` let a caller that knows no row filters skip the work (and a device sync)."""
    V = logits.shape[1]
    if use_top_k_p and (bool((top_k > 0).any()) or bool((top_p < 1.0).any())):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        ranks = torch.arange(V, device=logits.device)[None, :]
        drop = ranks >= k[:, None]
        probs = sorted_logits.softmax(-1)
        # a token is dropped when the tokens before it already cover top_p; the best one always stays
        # NOTE: top_p == 1 must mean "off": a float32 cumsum reaches 1.0 before the tail ends.
        drop |= ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if use_min_p and bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: (N, V) float32, one row per request in `reqs`. Returns token ids and logprobs."""
        logits = logits.float()
        raw = logits
        if any(r.params.has_penalties for r in reqs):
            logits = logits.clone()
            apply_penalties(logits, reqs)
        greedy_tokens = logits.argmax(-1)
        tokens = greedy_tokens.clone()
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            params = [reqs[i].params for i in rand]
            dev = logits.device
            sub = logits[rand] / torch.tensor([p.temperature for p in params], device=dev)[:, None]
            V = logits.shape[1]
            sub = filter_logits(
                sub,
                torch.tensor([min(p.top_k, V) for p in params], device=dev),
                torch.tensor([p.top_p for p in params], device=dev),
                torch.tensor([p.min_p for p in params], device=dev),
                use_top_k_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
                use_min_p=any(p.min_p > 0 for p in params),
            )
            probs = sub.softmax(-1)
            # Exponential race (Gumbel-max in another form): argmax(p / E) with E ~ Exp(1) samples p.
            noise = torch.empty_like(probs)
            for j, i in enumerate(rand):
                gen = reqs[i].generator or self.generator
                noise[j].exponential_(generator=gen)
            tokens[rand] = (probs / noise).argmax(-1)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            lp = raw[want].log_softmax(-1)
            k = max(reqs[i].params.logprobs for i in want)
            top_v, top_i = lp.topk(max(k, 1), dim=-1)
            chosen = lp.gather(1, tokens[want][:, None]).squeeze(1).tolist()
            for j, i in enumerate(want):
                n = reqs[i].params.logprobs
                top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
                logprobs[i] = TokenLogprob(token_list[i], chosen[j], top)
        return token_list, logprobs
