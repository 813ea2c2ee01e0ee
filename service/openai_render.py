"""OpenAI response bodies and stream chunks for chat and text completions; one renderer per choice (`n`).

Pure functions of finished (or streaming) `RequestHandle`s: no I/O, so the shapes are testable alone.
"""
from __future__ import annotations

import codecs
import time
import uuid
from collections import deque
from typing import Any, Protocol

import msgspec

from service import openai_reasoning, openai_tools
from service.openai_errors import HTTPError, error_body
from service.handle import PromptLogprobs, RequestHandle, TokenLogprobs
from service.openai_reasoning import ThinkStream
from service.openai_tools import ToolPlan, ToolStream


def usage(handles: list[RequestHandle], n: int = 1) -> dict[str, Any]:
    """A response's usage over its choices, `n` a prompt: each prompt counts once (with its first choice's
    prefix-cache hits), as OpenAI and vLLM count it; the completions add up."""
    firsts = handles[::n]
    prompt, completion = sum(h.prompt_tokens or 0 for h in firsts), sum(h.completion_tokens for h in handles)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(h.cached_tokens for h in firsts)}}
    if any(h.reasoning_tokens is not None for h in handles):  # (a reasoning parser split the answers)
        out["completion_tokens_details"] = {"reasoning_tokens": sum(h.reasoning_tokens or 0 for h in handles)}
    return out


def _finish_reason(h: RequestHandle) -> str:
    """OpenAI's value. An aborted request never gets here: openai_api answers it with an error."""
    assert h.finish_reason in ("stop", "length"), f"request {h.request_id} finished with {h.finish_reason!r}"
    return h.finish_reason


class Render(Protocol):
    """One choice of a response: its entry in the body and its stream chunks. `siblings` makes the renderers of
    a response's other choices, which share its id."""

    index: int

    def siblings(self, n: int) -> list[Render]: ...
    def choice(self, h: RequestHandle) -> dict[str, Any]: ...
    def response(self, renders: list[Render], handles: list[RequestHandle], n: int) -> dict[str, Any]: ...
    def stream_start(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]: ...
    def stream_prompt(self, include_usage: bool) -> list[dict[str, Any]]: ...
    def stream_delta(self, text: str, lps: list[TokenLogprobs], include_usage: bool) -> list[dict[str, Any]]: ...
    def stream_end(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]: ...
    def usage_chunk(self, handles: list[RequestHandle], n: int) -> dict[str, Any]: ...
    def event(self, chunk: dict[str, Any]) -> bytes: ...
    def stream_failed(self, h: RequestHandle, e: HTTPError) -> list[bytes]: ...
    def watch(self, h: RequestHandle) -> None: ...
    DONE: bytes


class _Base:
    ID_PREFIX = OBJECT = CHUNK_OBJECT = ""
    DONE = b"data: [DONE]\n\n"  # a stream's last event

    def __init__(self, model: str, logprobs: bool, index: int = 0, first: _Base | None = None, *,
                 token_ids: bool = False, prompt_logprobs: int | None = None) -> None:
        """`token_ids`: logprobs name each token `token_id:N` (vLLM's `return_tokens_as_token_ids`);
        `prompt_logprobs`: the answer has its prompt's logprobs, with this many top alternatives (vLLM's)."""
        self.id = first.id if first is not None else f"{self.ID_PREFIX}-{uuid.uuid4().hex}"
        self.created = first.created if first is not None else int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.index = index
        self.token_ids = first.token_ids if first is not None else token_ids
        self.prompt_logprobs = first.prompt_logprobs if first is not None else prompt_logprobs
        self.handle: RequestHandle | None = None  # a stream's (`stream_start`)

    def siblings(self, n: int) -> list[Render]:
        """This renderer (the first choice's) and those of the response's n - 1 other choices (over every prompt of a
        batch)."""
        return [self, *(type(self)(self.model, self.logprobs, i, self) for i in range(1, n))]

    def _name(self, token_id: int, name: str) -> str:
        return f"token_id:{token_id}" if self.token_ids else name

    def _prompt_lps(self, h: RequestHandle) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (the first: None), {token id: {logprob, rank, decoded_token}}
        for it and its top alternatives (ranked 1, 2, ...)."""
        def entry(i: int, name: str, lp: float, rank: int) -> tuple[str, dict[str, Any]]:
            return str(i), {"logprob": lp, "rank": rank, "decoded_token": self._name(i, name)}

        k = self.prompt_logprobs or 0  # (the engine's may be more: completions' echo asks for its `logprobs`)
        return [None if lp is None else dict([entry(i, name, lp, rank), *(
            entry(a, an, v, j) for j, (a, an, _, v) in enumerate(top[:k], start=1) if a != i)])
                for i, name, _, lp, rank, top, _ in (h.prompt_logprobs or [])]

    def choice(self, h: RequestHandle) -> dict[str, Any]:
        raise NotImplementedError

    def stream_prompt(self, include_usage: bool) -> list[dict[str, Any]]:
        return []  # (a chat streams no prompt logprobs)

    def watch(self, h: RequestHandle) -> None:
        """Before its first output: what `h` is to count in its text (a reasoning's end: ChatRender's)."""

    def event(self, chunk: dict[str, Any]) -> bytes:
        """A chunk as a server-sent event."""
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    def stream_failed(self, h: RequestHandle, e: HTTPError) -> list[bytes]:
        """The events that end a stream whose choice failed: the error's body, as a response's would be."""
        return [self.event(error_body(e.status, e.message, None, e.param, e.code)), self.DONE]

    def response(self, renders: list[Render], handles: list[RequestHandle], n: int) -> dict[str, Any]:
        """The whole (not streamed) body: each finished handle's choice, in order (`n` a prompt), encoded as it is
        made (n=128 choices of 300 tokens with their top 20 logprobs are 56 MB of JSON: made as one tree, its millions
        of objects made the collector walk them again and again, while the loop waited for the interpreter's lock)."""
        return {"id": self.id, "object": self.OBJECT, "created": self.created, "model": self.model,
                "choices": [msgspec.Raw(msgspec.json.encode(r.choice(h))) for r, h in zip(renders, handles)],
                "usage": self._usage(handles, n)}

    def usage_chunk(self, handles: list[RequestHandle], n: int) -> dict[str, Any]:
        """A stream's last chunk under `stream_options.include_usage`: no choices, the usage of them all."""
        return self._chunk([], True, self._usage(handles, n))

    def _usage(self, handles: list[RequestHandle], n: int) -> dict[str, Any]:
        return usage(handles, n)

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool, usage_: Any = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created, "model": self.model,
                 "choices": choices}
        if include_usage:
            chunk["usage"] = usage_
        return chunk


class ChatRender(_Base):
    ID_PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, logprobs: bool, index: int = 0, first: ChatRender | None = None, *,
                 echo: str = "", token_ids: bool = False, tools: ToolPlan | None = None,
                 prompt_logprobs: int | None = None, reasoning: str | None = None, opened: bool = True,
                 continued: str | None = None) -> None:
        """`echo`: the text each answer starts with (vLLM's `echo`: the last message's, an assistant's); `tools`: what
        the request's tools ask of the answer (service/openai_tools.py: its calls parsed out of the text);
        `reasoning`: the server's `--reasoning-parser` (service/openai_reasoning.py: the answer's reasoning apart, as
        `reasoning_content`; the tools parse its content; an echo of the continued message is split with it),
        `opened` unless the template did not open the answer (a grammar holds it from its first token, no generation
        prompt), `continued` the text of the message the answer continues (`continue_final_message`)."""
        super().__init__(model, logprobs, index, first, token_ids=token_ids, prompt_logprobs=prompt_logprobs)
        self.echo = first.echo if first is not None else echo
        self.tools = first.tools if first is not None else tools
        self.reasoning = first.reasoning if first is not None else reasoning
        # an echo of the message the answer continues is the answer's start, split with it (else it leads the content)
        self.echo_split = first.echo_split if first is not None else (
            reasoning is not None and bool(echo) and continued is not None)
        self.think_kwargs: dict[str, Any] = first.think_kwargs if first is not None else {
            "opened": opened and continued is None, "prefix": "" if self.echo_split else continued or ""}
        self.stream = ToolStream(self.tools) if self.tools is not None else None
        self.think = ThinkStream(self.reasoning, **self.think_kwargs) if self.reasoning is not None else None
        self.held: list[TokenLogprobs] = []  # a stream's logprobs of text the parsers hold back
        # with a reasoning parser: where each token's text ends in the answer (its bytes decoded), so its logprobs go
        # with the part that text is in (the reasoning's, or the content's)
        self.placed: deque[tuple[int, TokenLogprobs]] = deque()
        self.chars = len(self.echo) if self.echo_split else 0  # (the echo's characters come first)
        self.given: tuple[openai_reasoning.Kind, int] | None = None  # the last part given out: its kind, its end
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def watch(self, h: RequestHandle) -> None:
        if self.reasoning is not None:  # (its reasoning tokens: those up to the tag that ends it, which may start in
            # the text before the answer: the continued message's)
            h.watch(openai_reasoning.END, self.echo if self.echo_split else self.think_kwargs["prefix"])

    def response(self, renders: list[Render], handles: list[RequestHandle], n: int) -> dict[str, Any]:
        body = super().response(renders, handles, n)
        if self.prompt_logprobs is not None:  # (vLLM's: the response's, its prompt's)
            body["prompt_logprobs"] = self._prompt_lps(handles[0])
        return body

    def _lp(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(i: int, tok: str, raw: bytes, lp: float) -> dict[str, Any]:
            return {"token": self._name(i, tok), "logprob": lp, "bytes": list(raw)}

        return {"content": [{**entry(i, t, b, lp), "top_logprobs": [entry(*alt) for alt in top]}
                            for i, t, b, lp, top in lps], "refusal": None}

    def choice(self, h: RequestHandle) -> dict[str, Any]:
        text, _, lps = h.take()
        message: dict[str, Any] = {"role": "assistant", "content": None}
        echo = "" if self.echo_split else self.echo
        if self.reasoning is not None:
            message["reasoning_content"], text, think = openai_reasoning.split(
                self.reasoning, text, echo=self.echo if self.echo_split else "", **self.think_kwargs)
            h.reasoning_tokens = think.reasoning_tokens(h.watched, h.completion_tokens)
        # (an answer that was all reasoning has no content: null, as vLLM's)
        message["content"] = echo + text if echo or text or self.reasoning is None else None
        reason = _finish_reason(h)
        if self.tools is not None:
            content, calls = openai_tools.answer(self.tools, text)
            # (all reasoning, as above: null)
            message["content"] = (echo + content if content is not None and (echo or content or self.reasoning is None)
                                  else (echo or None))
            if calls:
                message["tool_calls"] = calls
            reason = openai_tools.finish_reason(self.tools, reason, bool(calls))
        return {"index": self.index, "message": message, "logprobs": self._lp(lps) if self.logprobs else None,
                "finish_reason": reason}

    def stream_start(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        chunks = [self._chunk([{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], include_usage)]
        if self.echo_split:
            chunks += self._parts(self.think.feed_echo(self.echo), include_usage)  # type: ignore[union-attr]
        elif self.echo:
            chunks.append(self._chunk([{"index": self.index, "delta": {"content": self.echo}, "logprobs": None,
                                        "finish_reason": None}], include_usage))
        return chunks

    def stream_delta(self, text: str, lps: list[TokenLogprobs], include_usage: bool) -> list[dict[str, Any]]:
        if self.think is not None:
            for lp in lps:
                self.chars += len(self.utf8.decode(lp[2]))
                self.placed.append((self.chars, lp))
            parts = self.think.feed(text)
            if not parts and self.given is not None and self.placed and self.placed[0][0] <= self.given[1]:
                # (a token of no text after a part, as the end token: with an empty delta of that part's kind)
                parts = [(self.given[0], "", self.given[1])]
            return self._parts(parts, include_usage)
        if self.stream is None:
            return [self._chunk([{"index": self.index, "delta": {"content": text},
                                  "logprobs": self._lp(lps) if self.logprobs else None, "finish_reason": None}],
                                include_usage)]
        return self._deltas(self.stream.feed(text), lps, include_usage)

    def _parts(self, parts: list[openai_reasoning.Part], include_usage: bool) -> list[dict[str, Any]]:
        """The reasoning parser's parts as chunks: its reasoning as `reasoning_content`, its content through the tool
        parser, if any; each with the logprobs of the tokens whose text ends in it (a tag's, the next part's)."""
        chunks: list[dict[str, Any]] = []
        for kind, piece, end in parts:
            self.given = (kind, end)
            mine = []
            while self.placed and self.placed[0][0] <= end:
                mine.append(self.placed.popleft()[1])
            if kind == "reasoning":
                deltas = [{"reasoning_content": piece}]
            else:
                deltas = self.stream.feed(piece) if self.stream is not None else [{"content": piece}]
            chunks += self._deltas(deltas, mine, include_usage)
        return chunks

    def _deltas(self, deltas: list[dict[str, Any]], lps: list[TokenLogprobs],
                include_usage: bool) -> list[dict[str, Any]]:
        """The parsers' deltas as chunks, the logprobs of their tokens with the first (held back meanwhile)."""
        self.held += lps
        if not deltas:
            return []
        held, self.held = self.held, []
        return [self._chunk([{"index": self.index, "delta": d, "logprobs": self._lp(held) if self.logprobs and k == 0
                              and held else None, "finish_reason": None}], include_usage)
                for k, d in enumerate(deltas)]

    def stream_end(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        reason = _finish_reason(h)
        chunks = []
        if self.think is not None:
            chunks = self._parts(self.think.end(), include_usage)
            h.reasoning_tokens = self.think.reasoning_tokens(h.watched, h.completion_tokens)
        self.held += [lp for _, lp in self.placed]  # (tokens past the text, if their bytes make more characters)
        self.placed.clear()
        if self.stream is not None:
            chunks += self._deltas(self.stream.end(reason), [], include_usage)
            reason = openai_tools.finish_reason(self.tools, reason, self.stream.calls > 0)  # type: ignore[arg-type]
        held, self.held = self.held, []  # (the end token's, say: no text of theirs to ride with)
        return chunks + [self._chunk([{"index": self.index, "delta": {},
                                       "logprobs": self._lp(held) if self.logprobs and held else None,
                                       "finish_reason": reason}], include_usage)]


class CompletionRender(_Base):
    ID_PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, logprobs: bool, index: int = 0, first: CompletionRender | None = None, *,
                 token_ids: bool = False, echo: list[str | None] | None = None, prompt_logprobs: int | None = None,
                 n: int = 1, top_logprobs: int = 0, prompt_only: bool = False) -> None:
        """`echo`: each prompt's text (None: its tokens' text), which its choices' answers start with (OpenAI's
        `echo`; with logprobs, its tokens' lead theirs, the first's null); `n`: choices per prompt; `top_logprobs`:
        the alternatives each token's logprobs list (`logprobs`); `prompt_only`: the answer is its echo alone (vLLM's
        `max_tokens` 0 with `echo`: a prompt scored, the one token the engine drew for it left out)."""
        super().__init__(model, logprobs, index, first, token_ids=token_ids, prompt_logprobs=prompt_logprobs)
        self.echo = first.echo if first is not None else echo
        self.n = first.n if first is not None else n
        self.top_logprobs = first.top_logprobs if first is not None else top_logprobs
        self.prompt_only = first.prompt_only if first is not None else prompt_only
        self.echoed = False  # a stream sent the prompt
        self.offset = 0  # text_offset of the next token, across stream chunks
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # the text the tokens' bytes have made so far

    def _echo(self, h: RequestHandle) -> tuple[str, dict[str, Any] | None]:
        """The prompt text this choice's answer starts with and, with logprobs, its tokens' (the first's null): the
        text the prompt's tokens make, decoded as an answer's is, when the engine sent them (with logprobs, a prompt
        of token ids, a truncated prompt), else the prompt as given. The answer's offsets go on after it."""
        plps: list[PromptLogprobs] | None = h.prompt_logprobs
        if plps is None:
            return self.echo[self.index // self.n], None  # type: ignore[index,return-value]
        offsets, at = [], 0
        for *_, piece in plps:
            offsets.append(at)
            at += len(piece)
        self.offset = at  # (the answer's tokens' offsets follow the prompt's text)
        lp = {"tokens": [self._name(i, name) for i, name, *_ in plps], "token_logprobs": [p[3] for p in plps],
              "top_logprobs": [None if lp is None else self._alternatives(top[: self.top_logprobs])
                               for _, _, _, lp, _, top, _ in plps], "text_offset": offsets}
        return "".join(p[6] for p in plps), lp

    def _alternatives(self, top: list[tuple[int, str, bytes, float]]) -> dict[str, float]:
        alts: dict[str, float] = {}
        for i, name, _, lp in top:  # (names rarely repeat; the likelier entry is kept)
            alts.setdefault(self._name(i, name), lp)
        return alts

    def _lp(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        """`text_offset`: where in the text each token's bytes begin; a token that continues a character split
        over tokens points at that character, whose text its last piece completes."""
        offsets, tops = [], []
        for _, _, raw, _, top in lps:
            offsets.append(self.offset + self._pending_chars(raw))
            self.offset += len(self.utf8.decode(raw))
            tops.append(self._alternatives(top))
        return {"tokens": [self._name(i, t) for i, t, _, _, _ in lps], "token_logprobs": [lp for _, _, _, lp, _ in lps],
                "top_logprobs": tops, "text_offset": offsets}

    def _pending_chars(self, raw: bytes) -> int:
        """The characters that bytes held back from earlier tokens (the start of a character) become before this
        token's bytes: none if its first byte continues that character, else one U+FFFD, as the text shows it."""
        pending = self.utf8.getstate()[0]
        if not pending or not raw:
            return 0
        try:
            codecs.getincrementaldecoder("utf-8")().decode(pending + raw[:1])
        except UnicodeDecodeError:
            return 1
        return 0

    def _usage(self, handles: list[RequestHandle], n: int) -> dict[str, Any]:
        u = usage(handles, n)
        return {**u, "completion_tokens": 0, "total_tokens": u["prompt_tokens"]} if self.prompt_only else u

    def choice(self, h: RequestHandle) -> dict[str, Any]:
        text, _, lps = h.take()
        if self.prompt_only:
            text, lps = "", []
        prompt, echoed = self._echo(h) if self.echo is not None else ("", None)
        logprobs = self._lp(lps) if self.logprobs else None
        if logprobs is not None and echoed is not None:
            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        choice = {"index": self.index, "text": prompt + text, "logprobs": logprobs, "finish_reason": self._reason(h)}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_lps(h)
        return choice

    def stream_start(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        self.handle = h
        return []

    def stream_prompt(self, include_usage: bool) -> list[dict[str, Any]]:
        """A stream's prompt chunk (its echo), once: when its first output came (with the prompt's tokens)."""
        if self.echo is None or self.echoed:
            return []
        self.echoed = True
        text, echoed = self._echo(self.handle)  # type: ignore[arg-type]
        return [self._chunk([{"index": self.index, "text": text, "logprobs": echoed if self.logprobs else None,
                              "finish_reason": None}], include_usage)]

    def _reason(self, h: RequestHandle) -> str:
        return "length" if self.prompt_only and h.finish_reason in ("stop", "length") else _finish_reason(h)

    def stream_delta(self, text: str, lps: list[TokenLogprobs], include_usage: bool) -> list[dict[str, Any]]:
        if self.prompt_only:
            return self.stream_prompt(include_usage)
        return self.stream_prompt(include_usage) + [self._chunk([{
            "index": self.index, "text": text, "logprobs": self._lp(lps) if self.logprobs else None,
            "finish_reason": None}], include_usage)]

    def stream_end(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        return self.stream_prompt(include_usage) + [self._chunk([{
            "index": self.index, "text": "", "logprobs": None, "finish_reason": self._reason(h)}], include_usage)]
