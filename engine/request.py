"""Sampling parameters, per-request state and the outputs the engine hands back.

A request's tokens are `prompt + outputs`; `num_computed_tokens` of them have KV in the cache.
The block manager owns a request's KV bookkeeping (block table, hashes, computed / cached / committed
counts): `allocate` sets it, `commit` moves it forward, `free` resets it; nothing else writes it.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.structured import StructuredOutput


class PromptTooLongError(ValueError):
    """The prompt does not fit in max_model_len with room for at least one new token (or for max_tokens: then
    `param` is "max_tokens")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidSamplingParam(ValueError):
    """A `SamplingParams` field out of range; `param` names the field (e.g. "temperature")."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


SAMPLING_EPS = 1e-5  # a temperature below it samples greedily


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: all the context the prompt leaves
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 = only the sampled one)
    # (vLLM's) the prompt's tokens' logprobs too (the model's, raw), with this many top alternatives each: the prompt is
    # computed whole (no prefix-cache hits), a bounded number of such prompt tokens a step (engine/scheduler.py)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False  # the text ends after a matched stop string instead of before it
    # (vLLM's) the first min_tokens tokens never end the request: EOS (even with ignore_eos) and stop_token_ids cannot
    # be sampled while fewer have been generated, and stop strings are looked for only in the text of later tokens
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # (OpenAI's) token id -> a bias in [-100, 100] added to its logit
    allowed_token_ids: list[int] | None = None  # (vLLM's) only these may be sampled
    # (vLLM's) words never generated: the last token of each one's tokens (with and without a leading space) is not
    # sampled where the output ends with the tokens before it
    bad_words: list[str] | None = None
    # the text must be JSON (of a schema), match a regular expression or be one of some strings (engine/structured.py)
    structured_output: StructuredOutput | None = None
    # any of penalties, logit_bias, allowed_token_ids, min_tokens, structured_output or bad_words: the sampler adjusts
    # this request's logits
    adjusts_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def need(ok: bool, param: str, rule: str) -> None:
            if not ok:
                raise InvalidSamplingParam(param, f"SamplingParams: {param} {rule}")

        def token_id(t: Any) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and t >= 0

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        need(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(-1 <= self.top_k <= 2**31 - 1, "top_k", f"must be -1, 0 (off) or a positive int32, got {self.top_k}")
        need(self.seed is None or 0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0.0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be a list of non-empty strings")
        need(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        need(not self.logit_bias or isinstance(self.logit_bias, dict) and all(
            token_id(t) and isinstance(b, (int, float)) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
             "logit_bias", "must map token ids (>= 0) to biases in [-100, 100]")
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        allowed = self.allowed_token_ids
        need(allowed is None or isinstance(allowed, list) and bool(allowed) and all(map(token_id, allowed)),
             "allowed_token_ids", "must be a non-empty list of token ids (>= 0)")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}")
        need(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             f"must be in [0, 20], got {self.prompt_logprobs}")
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < SAMPLING_EPS:  # (as vLLM) dividing by it would overflow the logits: greedy is its limit
            self.temperature = 0.0
        need(self.bad_words is None or isinstance(self.bad_words, list) and all(
            isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", "must be a list of words (non-empty strings)")
        need(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
             "structured_output", "must be an engine.structured.StructuredOutput")
        self.adjusts_logits = (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                               or self.min_tokens > 0 or self.structured_output is not None or bool(self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens, best first


class PromptLogprob(NamedTuple):
    """A prompt token's logprob under the model given the tokens before it, its rank among the vocabulary (1: the
    likeliest), and the `prompt_logprobs` most likely tokens there."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


PLACEHOLDER = -1  # a token id a running step samples (async scheduling): replaced before anything reads its value


class Request:
    """Mutable state of one request: status by the scheduler, KV bookkeeping by the block manager; read by the runner."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 client: Hashable = None):
        self.request_id = request_id
        self.client = client  # who asks (a server's peer address): the scheduler shares its seats between clients
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens resolved against the context the prompt leaves
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # params.prompt_logprobs: each prompt token's (the first has none), written by the runner as chunks compute
        # them (by position: a step run again writes the same), sent with the request's first token
        self.prompt_lps: list[PromptLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(prompt_token_ids))
        self.prompt_lps_sent = False
        # KV bookkeeping, written by the BlockManager only
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        # the step inputs' copy of `block_table` as an array (engine/step_inputs.py): of this list, its first
        # `block_table_seen` entries (`trim` lowers that: it pops, and appends may follow)
        self.block_row: Any = None
        self.block_row_of: list[int] | None = None
        self.block_table_seen = 0
        self.block_hashes: list[int] = []  # hashes of this request's full blocks, in order
        self.num_committed_blocks = 0  # leading blocks already published in the prefix cache
        self.admitted = False  # allocated once already, so cache stats count each prompt once
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.announced = False  # an output (maybe empty) has told the caller it was scheduled
        self.detok = None  # engine.detokenizer.IncrementalDetokenizer, set by the engine
        self.generator = None  # engine.sampler.SeededStream when params.seed is set
        self.prompt_tokens = None  # the sampler's: the prompt's distinct token ids on the device (repetition penalty)
        self.biases = None  # the sampler's: (token ids, values) of its logit_bias on the device, made once
        self.ban = None  # the sampler's: (token ids, -inf) of min_tokens_banned on the device, made once
        self.allowed = None  # the sampler's: allowed_token_ids as a mask over the vocabulary on the device, made once
        self.matcher = None  # params.structured_output's grammar matcher (xgrammar), set by the engine
        self.grammar = None  # its compiled grammar to come (a Future), while it compiles
        self.mask = None  # its next token's grammar mask, made ahead (a Future), until that token is committed
        self.mask_s = 0.0  # the seconds its last mask took
        self.mask_slow = False  # one took SLOW_MASK_S or more: the next are made off the step (engine/structured.py)
        self.fast_masks = 0  # masks since, each under SLOW_MASK_S (FAST_MASKS of them: back in the step)
        # params.bad_words as token ids, set by the engine: those of one token (never sampled; on the device once, the
        # sampler's) and those of more (their last token not sampled after the others)
        self.bad_tokens: list[int] = []
        self.bad_device = None
        self.bad_sequences: list[list[int]] = []
        # the tokens `params.min_tokens` keeps the sampler from drawing until that many are out (EOS, stop_token_ids),
        # set by the engine; None when there is no minimum (or nothing to keep out)
        self.min_tokens_banned: list[int] | None = None
        # async scheduling (engine.py): trailing entries of token_ids sampled by a step still running, their values
        # not known yet (PLACEHOLDER); the next step is scheduled as if they were (it reads them on the device)
        self.num_placeholders = 0
        # speculative decoding (engine/spec.py): this step's draft tokens, set by the scheduler, cleared after it
        self.draft: list[int] = []
        self.spec_k = 0  # draft tokens to propose next (0: the configured number)
        self.spec_misses = 0  # verifications in a row that kept no draft token
        self.spec_cooldown = 0  # steps left before proposing again
        self.num_draft_computed = 0  # tokens with the draft model's KV (draft:DIR), written by the block manager and engine
        self.spec_tokens = None  # prompt lookup's copy of token_ids as an array (engine/spec.py `_Tokens`)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are still to be computed and sent: its prompt is computed whole, not taken from the
        prefix cache."""
        return self.prompt_lps is not None and not self.prompt_lps_sent

    @property
    def waits_for_mask(self) -> bool:
        """Its grammar is slow to follow and its next mask is being made off the step (engine/structured.py), or is
        to be once its token in the running step (async scheduling) is committed: not scheduled meanwhile."""
        if self.matcher is None:
            return False
        if self.num_placeholders:  # (its mask, if any, is the running step's)
            return self.mask_slow
        return self.mask is not None and not self.mask.done()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def below_min_tokens(self) -> bool:
        """Its next token is one of the first `params.min_tokens`: it cannot end the request (the sampler's and the
        engine's test; tokens a running step samples, `num_placeholders`, are not out yet)."""
        return self.num_tokens - self.num_placeholders - self.num_prompt_tokens < self.params.min_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def reached_length(self, max_model_len: int) -> bool:
        """Its tokens end it by length: `max_tokens` of output, or the whole context."""
        return self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len

    @property
    def is_prefilling(self) -> bool:
        """More than one token lacks KV: the request is (re)computing its prompt."""
        return self.num_tokens - self.num_computed_tokens > 1

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, {self.num_computed_tokens}/{self.num_tokens})"


@dataclass
class Checkpoint:
    """What resumes a request in another engine (`LLMEngine.add_request(..., resume=)`) exactly where its caller
    is: the tokens it has been given, the characters of text they made, and its seeded generator's state after
    the last of them. Built from the request's outputs alone; everything else (penalty counts, the detokenizer,
    KV) is recomputed from these. An unseeded request resumes on the engine's generator."""

    output_token_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    rng_state: Any = None  # its SeededStream's state (`get_state`: (seed, counter)); None if it has none

    def advance(self, token_ids: list[int], text: str, rng_state: Any) -> None:
        """The caller was given these (a `RequestOutput`'s new tokens, text delta and generator state)."""
        self.output_token_ids += token_ids
        self.num_text_chars += len(text)
        if rng_state is not None:
            self.rng_state = rng_state

    def copy(self) -> Checkpoint:
        return Checkpoint(list(self.output_token_ids), self.num_text_chars, self.rng_state)


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, not totals)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None  # with its first token: its prompt's (the first: None)
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the prompt's tokens
    rng_state: Any = None  # with a new token of a seeded request: its generator's state after it (for `Checkpoint`)
    error: str | None = None  # finished ("abort") because the engine failed it, outside the model: why
    error_param: str | None = None  # with `error`: the request's field at fault (refused, not failed)


@dataclass
class CompletionOutput:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
