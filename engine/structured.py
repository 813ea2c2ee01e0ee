"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regular expression or a choice
of strings (OpenAI's `response_format`, vLLM's `guided_*`), with xgrammar's grammar matchers, as vLLM does.

Each such request has a `GrammarMatcher` (`Request.matcher`): before its token is drawn, the sampler masks every
token the grammar does not allow next (`Grammars.apply`, one bitmask for the batch); the engine feeds each committed
token to it (`LLMEngine._append_tokens`), and the request ends ("stop") once the grammar is complete and has taken
its end (EOS). Grammars compile on a thread of their own (xgrammar lets go of the GIL meanwhile): a schema can take
seconds or minutes, and the engine thread goes on stepping the other requests; one that compiles within
`SYNC_COMPILE_S` is admitted at once (its errors raised by `add_request`), a slower one when it is ready, and one
still compiling after `COMPILE_TIMEOUT_S` fails. Compiled grammars are kept per spec (the last `CACHE_SIZE`).
xgrammar is imported the first time a request asks for structured output.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch

log = logging.getLogger("sluice.engine")

SYNC_COMPILE_S = 0.05  # what `add_request` waits for a compile before it lets the request wait for it instead
COMPILE_TIMEOUT_S = 30.0  # a request whose grammar is still compiling then fails (the compile runs on, unused)
CACHE_SIZE = 64
CACHE_BYTES = 256 << 20  # xgrammar's own cache of compiled grammars

Kind = Literal["json", "json_object", "regex", "choice"]
KINDS = ("json", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's text must be: `json` (a JSON schema, as JSON text, in `spec`), `json_object` (any JSON
    object), `regex` (`spec` a regular expression), `choice` (`spec` a JSON list of the strings allowed). `param`
    names the request field it came from, for errors (`response_format`, vLLM's `guided_json`, ...)."""

    kind: Kind
    spec: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def choice(cls, options: list[str], param: str = "guided_choice") -> StructuredOutput:
        return cls("choice", json.dumps(options, ensure_ascii=False), param)


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
        self.vocab_size = vocab_size
        # NOTE: xgrammar takes added special tokens (<|im_start|>) for text: one could land inside a JSON string,
        # where the text (which never shows special tokens) would lose it. Only the grammar's end (EOS) may come.
        special = set(getattr(tokenizer, "all_special_ids", [])) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        self.banned = sorted(i for i in special if i not in eos_token_ids and 0 <= i < vocab_size)
        self._keep = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)  # a bitmask's words, AND'ed
        for i in self.banned:  # (int32 words: the top bit is the sign's)
            self._keep[i // 32] &= 0x7FFFFFFF if i % 32 == 31 else ~(1 << (i % 32))
        self._bitmask: torch.Tensor | None = None
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()  # by (kind, spec), compiling or done
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # a daemon: a compile that never ends must not hold the process at exit
        threading.Thread(target=self._compile_loop, name="sluice-grammar", daemon=True).start()

    def compile(self, so: StructuredOutput) -> Future:
        """The compiled grammar of `so`, to come (on the compile thread) or kept from an earlier request; the future
        raises ValueError if its schema, expression or choices cannot be compiled."""
        key = (so.kind, so.spec)
        if (done := self._compiled.get(key)) is not None and not (done.done() and done.exception() is not None):
            self._compiled.move_to_end(key)
            return done
        future: Future = Future()
        self._compiled[key] = future
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        self._jobs.put((so, future))
        return future

    def matcher(self, compiled: Any) -> Any:
        """A matcher at the grammar's start; ValueError if the grammar allows no token there (it matches nothing:
        the sampler would have nothing to draw)."""
        m = self.xgr.GrammarMatcher(compiled)
        first = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        m.fill_next_token_bitmask(first, 0)
        if not bool((first & self._keep).any()):
            raise ValueError("it matches no text: no token may begin it")
        return m

    def _compile_loop(self) -> None:
        while True:
            so, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._compile(so))
            except Exception as e:
                future.set_exception(e)

    def _compile(self, so: StructuredOutput) -> Any:
        try:
            # NOTE: JSON without whitespace between its tokens, as OpenAI's structured outputs write it: a model can
            # loop on whitespace forever where a grammar allows any (vLLM's `disable_any_whitespace`)
            if so.kind == "json":
                return self.compiler.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return self.compiler.compile_regex(so.spec)
            options = json.loads(so.spec)
            return self.compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            raise ValueError(f"cannot compile it: {reason}") from None

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """In place: -inf on every token of row `rows[i]` that `matchers[i]` does not allow next."""
        n, words = logits.shape[0], (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = torch.empty(max(n, 64), words, dtype=torch.int32)
        bitmask = self._bitmask[:n]  # (row i of the logits is row i of the bitmask: `indices` picks both)
        for i, m in zip(rows, matchers):
            m.fill_next_token_bitmask(bitmask, i)
        bitmask &= self._keep  # (the special tokens: out of every row)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab_size, indices=rows)
