"""Loop-side request types shared by the bridge and the two front ends (ws.py, openai_api.py).

A `RequestHandle` is written by the bridge and read by one consumer, both on the event loop;
whatever the consumer has not taken yet is merged, never queued per step.
"""
from __future__ import annotations

import functools
import ipaddress
import math
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from engine import PromptLogprob, SamplingParams, TokenLogprob
from engine.detokenizer import IncrementalDetokenizer, TokenText
from service.protocol import ErrorCode

if TYPE_CHECKING:
    from starlette.requests import HTTPConnection

# (token id, its name, its bytes, logprob, ((top token's id, name, bytes, logprob), ...)) per generated token
# (engine/detokenizer.py TokenText: a token's own bytes may split a character; its name writes such bytes `\xNN`):
# the renderers' form, made from a request's `TokenScores` (four arrays) as a response takes them.
TokenLogprobs = tuple[int, str, bytes, float, tuple[tuple[int, str, bytes, float], ...]]
# a prompt token's: (id, name, bytes, logprob, rank, top, its piece of the prompt's text); the first token's logprob
# and rank None
PromptLogprobs = tuple[int, str, bytes, float | None, int | None, list[tuple[int, str, bytes, float]], str]


class PromptScores(NamedTuple):
    """A prompt's ids and the engine's logprobs of them, before any name, in flat arrays: a long prompt's are thousands
    of tokens, each with its top alternatives, too many to name on the engine thread or the loop (`named`, on the
    tokenizer thread: service/bridge.py `off_loop`), and as Python objects, millions to pickle, unpickle and have the
    cyclic collector scan (a full collection holds every thread of the process). `of`: from the engine's list."""
    token_ids: list[int]
    logprobs: array | None  # per token (the first: NaN); None: no logprobs, the ids alone (an echo's text)
    ranks: array | None
    counts: array | None  # each token's number of top alternatives, in `top_ids` / `top_logprobs` in turn
    top_ids: array | None
    top_logprobs: array | None

    @classmethod
    def of(cls, token_ids: list[int], logprobs: list[PromptLogprob | None] | None) -> PromptScores:
        if logprobs is None:
            return cls(token_ids, None, None, None, None, None)
        lps, ranks, counts, top_ids, top_lps = array("d"), array("q"), array("q"), array("q"), array("d")
        for lp in logprobs:
            if lp is None:
                lps.append(math.nan), ranks.append(0), counts.append(0)
                continue
            lps.append(lp.logprob), ranks.append(lp.rank), counts.append(len(lp.top))
            for i, v in lp.top:
                top_ids.append(i), top_lps.append(v)
        return cls(token_ids, lps, ranks, counts, top_ids, top_lps)

    def named(self, tt: TokenText) -> list[PromptLogprobs]:
        """The renderers' form: each token's name, bytes and piece of the prompt's text, decoded as an answer's
        text is (a character split over tokens comes with its last); the first token's logprob and rank None."""
        det = IncrementalDetokenizer(tt.tokenizer, [], [])
        out: list[PromptLogprobs] = []
        at = 0  # (in the top arrays)
        for j, t in enumerate(self.token_ids):
            det.add_token(t)
            lp = None if self.logprobs is None or math.isnan(self.logprobs[j]) else self.logprobs[j]
            top: list[tuple[int, str, bytes, float]] = []
            if self.counts is not None and (k := self.counts[j]):
                top = [(a, tt.name(a), tt.bytes(a), v) for a, v in zip(self.top_ids[at:at + k],  # type: ignore[index]
                                                                       self.top_logprobs[at:at + k])]  # type: ignore
                at += k
            out.append((t, tt.name(t), tt.bytes(t), lp, None if lp is None else self.ranks[j],  # type: ignore[index]
                        top, det.delta(False)))
        if out and (rest := det.delta(True)):
            out[-1] = (*out[-1][:6], out[-1][6] + rest)
        return out


class TokenScores(NamedTuple):
    """An answer's tokens' logprobs as the engine gives them, before any name, in flat arrays: each token's id and
    logprob, and its `k` top alternatives (the request's `logprobs`, as many for every token) in turn in `top_ids` /
    `top_logprobs`. They are named when a response takes them (`RequestHandle.take`: a stream's on the loop, a whole
    response's on the tokenizer thread), by the server's frozen `TokenText`. Until then a token with its top 20 is
    ~270 bytes, not the ~4,900 of named tuples: an answer kept whole until it ends (with `n` choices, in every seat)
    or merged for a client that reads slowly holds an eighteenth of what it did (a 32k-token answer: 9 MB, not 160),
    and the engine thread names nothing (256 streams with their top 20: ~1.8 ms of each step). `of`: from the
    engine's list."""
    token_ids: array  # "i"
    logprobs: array  # "d"
    top_ids: array  # "i", k per token
    top_logprobs: array  # "d"

    @classmethod
    def empty(cls) -> TokenScores:
        return cls(array("i"), array("d"), array("i"), array("d"))

    @classmethod
    def of(cls, logprobs: list[TokenLogprob]) -> TokenScores:
        return cls(array("i", [lp.token_id for lp in logprobs]), array("d", [lp.logprob for lp in logprobs]),
                   array("i", [t for lp in logprobs for t, _ in lp.top]),
                   array("d", [v for lp in logprobs for _, v in lp.top]))

    def extend(self, more: TokenScores) -> None:
        for mine, theirs in zip(self, more):
            mine.extend(theirs)

    def named(self, tt: TokenText) -> list[TokenLogprobs]:
        """The renderers' form (`TokenLogprobs`): each token and alternative with its name and bytes."""
        n = len(self.token_ids)
        k = len(self.top_ids) // n if n else 0
        # (a frozen TokenText's lists, indexed: a quarter of the time of its methods; ids are the model's, below the
        # size it was frozen to)
        name, raw = (tt.names.__getitem__, tt.raw.__getitem__) if tt.frozen else (tt.name, tt.bytes)
        tops = [(t, name(t), raw(t), v) for t, v in zip(self.top_ids, self.top_logprobs)]
        return [(t, name(t), raw(t), v, tuple(tops[j * k:(j + 1) * k]))
                for j, (t, v) in enumerate(zip(self.token_ids, self.logprobs))]


class RequestError(Exception):
    """A request refused or failed; `code` is a protocol error code (docs/protocol.md §6), `param` the request
    field at fault when one is."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.param = param


def sampling_params(defaults: Mapping[str, Any], **kwargs: Any) -> SamplingParams:
    """`SamplingParams(**kwargs)` over `defaults` (the model's generation config's, `LLMEngine.sampling_defaults`), its
    refusal as a `RequestError`: built once, on the loop, carried to the engine. `kwargs` are what the client set (a
    None is unset); the defaults' `max_tokens` caps the request's, set or not (vLLM's `max_new_tokens`)."""
    set_ = {k: v for k, v in kwargs.items() if v is not None}
    merged = {**defaults, **set_}
    if (cap := defaults.get("max_tokens")) is not None and "max_tokens" in set_:
        merged["max_tokens"] = min(set_["max_tokens"], cap)
    try:
        return SamplingParams(**merged)
    except (ValueError, TypeError) as e:
        raise RequestError("invalid_message", f"invalid sampling parameters: {e}", getattr(e, "param", None)) from None


def client_of(conn: HTTPConnection) -> str:
    """Who asks, as `GenerateRequest.client` knows it: an HTTP request's or a WebSocket's peer address (uvicorn's:
    a trusted proxy's X-Forwarded-For) as `client_key` groups it, "-" where there is none. The tokenizer's and grammar
    compiler's turns, the admission queue's shares and the engine's seats go by it (the HTTP loop budget goes by the
    socket's own peer, grouped the same way)."""
    return client_key(conn.client.host) if conn.client else "-"


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@functools.lru_cache(maxsize=4096)
def client_key(host: str) -> str:
    """The client a peer address belongs to: an internet IPv6 address is its /64 ("2001:4860:1:2::/64"), the least
    a site is given, so one host's 2^64 addresses (privacy addresses, or one per connection) are one client and not
    that many shares of the queue, the seats and the loop; an IPv4 address as IPv6 (a dual-stack socket's
    "::ffff:192.0.2.1", NAT64's "64:ff9b::c000:201") is the IPv4 address; any other address is itself (IPv4;
    loopback, link-local and private IPv6, where hosts on one LAN share a /64), and anything not an address (a
    proxy's name, "-") is as given."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if ip in _NAT64:  # (an IPv4 client translated to IPv6, by SIIT or NAT64: one /64 for every such client)
            return str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.is_global:
            return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(frozen=True)
class GenerateRequest:
    # chat messages (chat=True: {"role", "content"} dicts or objects with those attributes), or raw text / token ids
    prompt: Sequence[Any] | str | list[int]
    chat: bool
    params: SamplingParams  # max_tokens None: all the context the prompt leaves
    fit_max_tokens: bool = True  # cap max_tokens to the context the prompt leaves; False: refuse the request
    api: str = "ws"  # metrics label
    # who asks: the peer's address (a WebSocket's or an HTTP request's). Clients take turns on the tokenizer, each may
    # hold a share of the admission queue, and the engine shares its running seats between them
    client: str | None = None
    # the tokenizer's own special tokens (vLLM's add_special_tokens; None: for a text, not for a chat's template)
    add_special_tokens: bool | None = None
    # a chat's template options (vLLM's, engine/processor.py `chat_ids`)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's), once tokenized
    tools: list[dict[str, Any]] | None = None  # a chat's tools, for its template (service/openai_tools.py)
    documents: list[dict[str, Any]] | None = None  # (vLLM's) a chat's documents, for its template
    template_kwargs: dict[str, Any] | None = None  # (vLLM's chat_template_kwargs) more variables for its template
    echo_ids: bool = False  # the prompt's ids go to its handle (`prompt_scores`, no logprobs): an echo's text


class RequestHandle:
    """One request in flight. The bridge `push`es outputs in; the consumer `take()`s them out, merged."""

    def __init__(self, request_id: str, api: str, notify: Callable[[], None], names: TokenText | None = None) -> None:
        self.request_id = request_id
        self.names = names  # the server's frozen TokenText: `take` names logprobs with it
        self.api = api
        self.notify = notify  # wakes the consumer; called on the loop after every change
        self.arrival = time.monotonic()
        self.prompt_tokens: int | None = None  # set by `start`
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.queue_s = 0.0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.error: RequestError | None = None
        self._text: list[str] = []
        self._tokens = 0
        self._logprobs: TokenScores | None = None
        self._watch: str | None = None  # (`watch`)
        self._tail = ""
        self.watched: int | None = None  # the tokens up to the end of the watched text, once it came
        self.reasoning_tokens: int | None = None  # the answer's reasoning's, where a reasoning parser split it
        self.prompt_scores: PromptScores | None = None  # with the first token, if asked for
        self.prompt_logprobs: list[PromptLogprobs] | None = None  # those named, once a response needs them

    @property
    def started(self) -> bool:
        """Scheduled by the engine (its first output came), or ended before it was: prompt counts are known."""
        return self.prompt_tokens is not None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def start(self, prompt_tokens: int, cached_tokens: int, at: float) -> None:
        assert not self.started, f"request {self.request_id} started twice"
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        self.queue_s = max(0.0, at - self.arrival)

    def push(self, text: str, num_tokens: int, logprobs: TokenScores | None) -> None:
        self.completion_tokens += num_tokens
        self._tokens += num_tokens
        if text:
            self._text.append(text)
            if self._watch is not None:
                self._find(text)
        if logprobs is not None and logprobs.token_ids:
            if self._logprobs is None:
                self._logprobs = TokenScores.empty()  # (its own: a delivery's arrays are not this handle's to grow)
            self._logprobs.extend(logprobs)

    def watch(self, text: str, lead: str = "") -> None:
        """Count the answer's tokens up to the end of `text`'s first appearance in it (`watched`): a reasoning's
        closing tag, where its reasoning tokens end. `lead`: the text before the answer (a continued message's),
        which may hold the start of it. Before anything is pushed."""
        self._watch, self._tail = text, lead[1 - len(text):] if len(text) > 1 else ""

    def _find(self, text: str) -> None:
        window = self._tail + text
        if self._watch in window:  # (the tokens through the push whose text completes it)
            self.watched, self._watch = self.completion_tokens, None
        else:  # (what could be the start of it: it may end in the next push)
            self._tail = window[1 - len(self._watch):] if len(self._watch) > 1 else ""

    def finish(self, reason: str | None, error: RequestError | None) -> None:
        assert not self.finished, f"request {self.request_id} finished twice"
        self.finished_at = time.monotonic()
        self.finish_reason, self.error = reason, error

    def take(self) -> tuple[str, int, list[TokenLogprobs]]:
        """Everything not yet taken, merged: (text, number of tokens, logprobs named)."""
        text, tokens, scores = "".join(self._text), self._tokens, self._logprobs
        self._text, self._tokens, self._logprobs = [], 0, None
        if scores is None:
            return text, tokens, []
        assert self.names is not None, f"request {self.request_id}: logprobs but no TokenText to name them"
        return text, tokens, scores.named(self.names)

    def timing_ms(self) -> tuple[float, float | None, float]:
        """(queue, time to first token or None, total) in milliseconds since arrival."""
        end = self.finished_at or time.monotonic()
        ttft = None if self.first_token_at is None else (self.first_token_at - self.arrival) * 1e3
        return self.queue_s * 1e3, ttft, (end - self.arrival) * 1e3


class TokenRate:
    """Generated tokens per second over the last few seconds of stats snapshots."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.points: list[tuple[float, int]] = []

    def add(self, t: float, total: int) -> None:
        self.points.append((t, total))
        while len(self.points) > 2 and t - self.points[0][0] > self.window_s:
            self.points.pop(0)

    def per_s(self, now: float) -> float:
        if len(self.points) < 2 or now - self.points[-1][0] > self.window_s:
            return 0.0
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
