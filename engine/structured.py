r"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regular expression or a choice
of strings (OpenAI's `response_format`, vLLM's `guided_*`), with xgrammar's grammar matchers, as vLLM does.

Each such request has a `GrammarMatcher` (`Request.matcher`): before its token is drawn, the sampler masks every
token the grammar does not allow next (`Grammars.apply`, one bitmask for the batch); the engine feeds each committed
token to it (`LLMEngine._append_tokens`), and the request ends ("stop") once the grammar is complete and has taken
its end (EOS). Grammars compile on a thread of their own (xgrammar lets go of the GIL meanwhile): a schema can take
seconds or minutes, and the engine thread goes on stepping the other requests; one that compiles within
`SYNC_COMPILE_S` is admitted at once (its errors raised by `add_request`), a slower one when it is ready, and one
compiling for `COMPILE_TIMEOUT_S` (its time queued behind others' not counted) fails, and a queued compile no
request waits for any more is dropped. Compiled grammars are kept per spec (the last `CACHE_SIZE`), with
the mask of their start, made on that thread too.
xgrammar is imported the first time a request asks for structured output.

A mask is usually tens of microseconds, but an ambiguous expression can take a second a token (`(\w+\s?){1,50}`
takes 0.1-0.2 s at a vocabulary of 8,192; `((a{1,100}){1,100}){1,100}` over a second by its 110th token), and a mask
made in the step stalls every request in it. So each mask's CPU time is measured: once one took `SLOW_MASK_S` or
more, the request's next masks (until `FAST_MASKS` in a row are fast) are made on a thread of their own at the lowest
priority, each as soon as its token is committed (`fill_later`), and the scheduler leaves it out until its mask is
ready (`Request.waits_for_mask`): it slows only itself. A request whose mask took `MASK_LIMIT_S` fails, its field
named; one that ends has its queued mask cancelled.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from engine.fair_executor import FairExecutor

if TYPE_CHECKING:
    from engine.request import Request

log = logging.getLogger("sluice.engine")

SYNC_COMPILE_S = 0.05  # what `add_request` waits for a compile before it lets the request wait for it instead
COMPILE_TIMEOUT_S = 30.0  # a request whose grammar has compiled this long fails (the compile runs on, unused)
CACHE_SIZE = 64
CACHE_BYTES = 256 << 20  # xgrammar's own cache of compiled grammars
SLOW_MASK_S = 0.002  # a request whose mask took this long has the next filled between its steps, off the step
MASK_LIMIT_S = 5.0  # a request whose mask took this long fails: its grammar is too costly to follow
MASK_NICE = 19  # the mask thread's priority: a slow grammar's work yields to the step's
FAST_MASKS = 8  # a slow request whose masks took under SLOW_MASK_S this many times in a row has them made in the step

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's text must be: `json` (a JSON schema, as JSON text, in `spec`), `json_object` (any JSON
    object), `regex` (`spec` a regular expression), `choice` (`spec` a JSON list of the strings allowed), `grammar`
    (`spec` a context-free grammar: EBNF as xgrammar and llama.cpp's GBNF write it, `root ::= ...`, or Lark's, `start:
    ...`), `structural_tag` (`spec` xgrammar's structural tag as JSON text, `{"type": "structural_tag", "format":
    {...}}`: tagged parts held to formats, e.g. JSON of a schema between `<function=f>` and `</function>`). `param`
    names the request field it came from, for errors (`response_format`, vLLM's `guided_json`, ...). `after`: the
    text the grammar starts after, any text up to it free (a reasoning model's `</think>`: its reasoning free, its
    answer held, as vLLM holds a reasoning model's; one that is a special token, never in the text, is ignored: the
    grammar holds the whole text); a text that never writes it is free, and may end. `opens`, with
    `after`: the free text must open with it (qwen3's `<think>`, which its model may not write): a text that does not
    is held from its start; a grammar that may itself begin with it is held whole, as without `after` (its own
    reasoning format)."""

    kind: Kind
    spec: str = ""
    param: str = "response_format"
    after: str = ""
    opens: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def choice(cls, options: list[str], param: str = "guided_choice") -> StructuredOutput:
        return cls("choice", json.dumps(options, ensure_ascii=False), param)


class Compiled(NamedTuple):
    """A compiled grammar (xgrammar's), with the mask of its start and the CPU seconds that mask took."""

    grammar: Any
    first_mask: torch.Tensor
    first_mask_s: float


_workers: dict[str, FairExecutor] = {}  # one per kind of job for the process, shared by its engines (a rebuilt one's)
_workers_lock = threading.Lock()


def _worker(name: str, nice: int = 0) -> FairExecutor:
    """The process's daemon thread `name` (a compile that never ends must not hold the process at exit), running jobs
    with their clients in turn (xgrammar lets go of the GIL meanwhile); `nice`: its priority (Linux)."""

    def lower() -> None:
        if nice and sys.platform == "linux":  # (where a thread has a priority of its own)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError:
                pass

    with _workers_lock:
        if name not in _workers:
            _workers[name] = FairExecutor(name, lower)
        return _workers[name]


class Grammars:
    """One engine's grammar compiler (over its tokenizer's vocabulary and the model's vocabulary size) and the
    matchers it makes."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        import xgrammar  # (seconds at first import: only once a request asks for structured output)

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_token_ids))
        # (its cache of compiled grammars is bounded: every distinct schema a client sends would stay in it)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self.info = info
        self.vocab_size = vocab_size
        # NOTE: xgrammar takes added special tokens (<|im_start|>) for text: one could land inside a JSON string,
        # where the text (which never shows special tokens) would lose it. Only the grammar's end (EOS) may come.
        special = set(getattr(tokenizer, "all_special_ids", [])) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        self.banned = sorted(i for i in special if i not in eos_token_ids and 0 <= i < vocab_size)
        self.banned_text = set(tokenizer.convert_ids_to_tokens(self.banned))  # (an `after` that is one: never written)
        self._keep = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)  # a bitmask's words, AND'ed
        for i in self.banned:  # (int32 words: the top bit is the sign's)
            self._keep[i // 32] &= 0x7FFFFFFF if i % 32 == 31 else ~(1 << (i % 32))
        self._bitmask: torch.Tensor | None = None
        self._compiled: OrderedDict[tuple[str, ...], Future] = OrderedDict()  # by (kind, spec, after, opens)
        self._waiting: dict[Future, int] = {}  # compiles not done yet: how many requests wait for each (engine thread)
        self._turns: dict[Future, dict[Hashable, Future]] = {}  # a compile not done yet: its job in each client's turn
        # NOTE: compiles at the usual priority: a request waits COMPILE_TIMEOUT_S of wall time for its own (at the
        # lowest, beside a forward that keeps the cores busy, a 0.5 s compile took over 30 s and was refused)
        self._compiles = _worker("sluice-grammar")
        # a slow grammar's masks at the lowest priority: on a host whose cores the forward keeps busy (a CPU's), the
        # mask thread took a core from it, and with it every request's step (a free stream beside a slow regex on two
        # cores: 28 ms a token instead of 13, 0.2 s at worst); at the lowest it takes what the steps leave, so on a
        # saturated host such a request crawls (its own cost, deferred), and on a GPU's it runs on an idle core.
        # Never behind a compile, which can take minutes.
        self._masks = _worker("sluice-grammar-mask", MASK_NICE)

    def compile(self, so: StructuredOutput, client: Hashable = None) -> Future:
        """The compiled grammar of `so` (`Compiled`), to come (on the compile thread, in `client`'s turn: one client's
        dozen slow schemas hold another's next compile behind one of them, not all) or kept from an earlier request;
        the future raises ValueError if its schema, expression or choices cannot be compiled, or if the grammar
        allows no token at its start (it matches nothing: the sampler would have nothing to draw)."""
        key = (so.kind, so.spec, so.after, so.opens)
        if (done := self._compiled.get(key)) is not None and not (done.done() and done.exception() is not None):
            self._compiled.move_to_end(key)
            if not done.done():  # (one no request waited for any more, running on: waited for again)
                self._waiting[done] = self._waiting.get(done, 0) + 1
                turns = self._turns.setdefault(done, {})
                if not done.running() and client not in turns:  # queued in other clients' turns: in this one's too
                    turns[client] = self._compiles.submit(client, self._run, done, so)
            return done
        future: Future = Future()  # (the compile, made in the first turn of a client that asked for it)
        self._compiled[key] = future
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        self._waiting[future] = 1
        self._turns[future] = {client: self._compiles.submit(client, self._run, future, so)}
        return future

    def _run(self, future: Future, so: StructuredOutput) -> None:
        """On the compile thread, in a client's turn: `so` compiled into `future`, unless an earlier turn of another
        client that asked for it has (its job in this client's turn then costs nothing): a schema another client
        queued too is compiled in whichever client's turn comes first, not in the first asker's alone (a hostile
        client that queued a common schema behind a dozen slow ones of its own held every other request for it)."""
        if future.done() or future.running():
            return
        future.started = time.monotonic()  # type: ignore[attr-defined]  # (its time limit's origin)
        if not future.set_running_or_notify_cancel():  # (dropped: no request waits for it any more)
            return
        try:
            future.set_result(self._first_mask(*self._compile(so)))
        except BaseException as e:  # the requests' to see
            future.set_exception(e)

    def release(self, future: Future) -> None:
        """A request no longer waits for `future`, from `compile` (it has its grammar, ended, or gave up). A compile
        no request waits for that has not begun is dropped: a client that cancels its structured requests leaves no
        work queued before others' compiles. (One running goes on: xgrammar's compile cannot be stopped.)"""
        left = self._waiting.pop(future, 0) - 1
        if left > 0:
            self._waiting[future] = left
            return
        for job in self._turns.pop(future, {}).values():
            job.cancel()  # (its queued turns: out of the queue)
        if future.cancel():  # (True only for a compile not begun)
            for key in [k for k, f in self._compiled.items() if f is future]:
                del self._compiled[key]

    def start(self, req: Request, compiled: Compiled) -> None:
        """Gives `req` a matcher at the grammar's start, and the first mask, made with the grammar."""
        req.matcher, req.mask = self.xgr.GrammarMatcher(compiled.grammar), Future()
        req.mask.set_result(compiled.first_mask)  # (shared by the requests of the grammar: only read)
        _timed(req, compiled.first_mask_s)

    def _first_mask(self, grammar: Any, free: str) -> Compiled:
        """`free`: a free text the grammar starts after (its start allows every token: what matters is the grammar's,
        after it)."""
        first = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        seconds = _fill(self.xgr.GrammarMatcher(grammar), first)
        if free:
            matcher, held = self.xgr.GrammarMatcher(grammar), self.xgr.allocate_token_bitmask(1, self.vocab_size)
            if not matcher.accept_string(free):
                raise ValueError(f"its free text cannot end with {free!r}")
            _fill(matcher, held)
        else:
            held = first
        if not bool((held & self._keep).any()):
            raise ValueError("it matches no text: no token may begin it")
        return Compiled(grammar, first, seconds)

    def fill_later(self, req: Request) -> None:
        """After `req`'s matcher took a token: if a mask of its grammar was slow, the next is filled on the mask
        thread now (`Request.waits_for_mask` holds it back until then), else by the sampler when it is drawn."""
        req.mask = None
        if req.mask_slow:
            matcher = req.matcher

            def fill() -> torch.Tensor:
                mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
                _timed(req, _fill(matcher, mask))
                return mask

            req.mask = self._masks.submit(req.client, fill)

    def _compile(self, so: StructuredOutput) -> tuple[Any, str]:
        """The compiled grammar, and the free text that leads to its own start ("" if none)."""
        alone = StructuredOutput(so.kind, so.spec, so.param)
        if not so.after:
            return self._compile_alone(alone), ""
        if so.after in self.banned_text:  # (a special token, never in the text: a free text could never end)
            return self._compile_alone(alone), ""
        if so.opens:  # (a grammar that may itself begin with `opens`: its own reasoning format, held whole)
            compiled = self._compile_alone(alone)
            if self.xgr.GrammarMatcher(compiled).accept_string(so.opens):
                return compiled, ""
        # any text up to `after` (xgrammar's structural tag of any text, which ends at its end tag), then the grammar;
        # or any text without it, which may end (an answer that never writes it: a model that did not reason); with
        # `opens`, both only after it, or else the grammar from the start
        free = {"type": "tag", "begin": so.opens, "content": {"type": "any_text"}, "end": so.after}
        unheld = {"type": "any_text", "excludes": [so.after]}
        if so.opens:
            unheld = {"type": "sequence", "elements": [{"type": "const_string", "value": so.opens}, unheld]}
        try:
            if so.kind == "structural_tag":  # (one structural tag: its token names resolved by the compiler)
                fmt = json.loads(so.spec).get("format")
                if fmt is None:
                    raise ValueError("a structural tag after free text must give its `format`")
                branches = [{"type": "sequence", "elements": [free, fmt]}, unheld] + ([fmt] if so.opens else [])
                return self.compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": {
                    "type": "or", "elements": branches}})), so.opens + so.after
            g = self.xgr.Grammar

            def tag(fmt: dict) -> Any:
                return g.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))

            held = self._grammar(so)
            branches = [g.concat(tag(free), held), tag(unheld)] + ([held] if so.opens else [])
            return self.compiler.compile_grammar(g.union(*branches)), so.opens + so.after
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise ValueError(f"cannot compile it: {reason}") from None

    def _grammar(self, so: StructuredOutput) -> Any:
        """`so`'s grammar, not compiled (as `_compile_alone` compiles it; a structural tag is compiled whole)."""
        g = self.xgr.Grammar
        if so.kind in ("json", "json_object"):
            return g.from_json_schema(so.spec if so.kind == "json" else '{"type": "object"}', any_whitespace=False)
        if so.kind == "regex":
            return g.from_regex(so.spec)
        if so.kind == "grammar":
            return g.from_ebnf(so.spec) if "::=" in so.spec else g.from_lark(so.spec, tokenizer_info=self.info)
        return g.from_ebnf(_choice_ebnf(so.spec))

    def _compile_alone(self, so: StructuredOutput) -> Any:
        try:
            # NOTE: JSON without whitespace between its tokens, as OpenAI's structured outputs write it: a model can
            # loop on whitespace forever where a grammar allows any (vLLM's `disable_any_whitespace`)
            if so.kind == "json":
                return self.compiler.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return self.compiler.compile_regex(so.spec)
            if so.kind == "grammar":  # (EBNF's rules are written `::=`, Lark's `:`)
                return (self.compiler.compile_grammar(so.spec) if "::=" in so.spec else
                        self.compiler.compile_lark(so.spec))
            if so.kind == "structural_tag":
                return self.compiler.compile_structural_tag(so.spec)
            return self.compiler.compile_grammar(_choice_ebnf(so.spec))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise ValueError(f"cannot compile it: {reason}") from None

    def apply(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
        """In place: -inf on every token of row `rows[i]` that `reqs[i]`'s grammar does not allow next (its mask made
        ahead, `start` and `fill_later`, or filled now and timed)."""
        n, words = logits.shape[0], (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = torch.empty(max(n, 64), words, dtype=torch.int32)
        bitmask = self._bitmask[:n]  # (row i of the logits is row i of the bitmask: `indices` picks both)
        for i, r in zip(rows, reqs):
            if r.mask is not None:  # (kept until its token is committed: a step run again uses it again)
                bitmask[i] = r.mask.result()[0]
            else:
                _timed(r, _fill(r.matcher, bitmask, i))
        bitmask &= self._keep  # (the special tokens: out of every row)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab_size, indices=rows)


def _choice_ebnf(spec: str) -> str:
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in json.loads(spec))


def _fill(matcher: Any, bitmask: torch.Tensor, row: int = 0) -> float:
    """Row `row` of `bitmask`: the tokens `matcher` allows next; returns the CPU seconds it took."""
    started = time.thread_time()
    matcher.fill_next_token_bitmask(bitmask, row)
    return time.thread_time() - started


def _timed(req: Request, seconds: float) -> None:
    """`req`'s last mask took `seconds`. NOTE: one slow mask has the next made ahead until FAST_MASKS in a row were
    fast: a grammar's cost swings from token to token (one of words and spaces is cheap inside a word, slow after
    it), and each slow one made in the step stalls it; but a request whose masks are made ahead takes a step at most
    every other one (its next mask starts once its token is committed), and a JSON schema's occasional slow mask
    must not halve its speed for the rest of its answer."""
    req.mask_s = seconds
    if seconds >= SLOW_MASK_S:
        req.mask_slow, req.fast_masks = True, 0
    elif req.mask_slow:
        req.fast_masks += 1
        req.mask_slow = req.fast_masks < FAST_MASKS
