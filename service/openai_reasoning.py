"""A reasoning model's answer split into its reasoning and its content, as vLLM's `--reasoning-parser` splits it.

Reasoning models write their thinking between `<think>` and `</think>` before the answer (their tokenizers show those
tags as text). Two conventions, by the server's `--reasoning-parser`:

- `deepseek_r1` (DeepSeek-R1 and its distills, Qwen3's thinking-only releases): the chat template opens `<think>` in
  the prompt, so the answer starts in its reasoning (a `<think>` the model writes anyway is dropped) and its content
  starts after `</think>`; an answer that never closes it is all reasoning;
- `qwen3` (Qwen3's hybrid models, whose reasoning `enable_thinking: false` turns off): the answer is reasoning only if
  it starts with `<think>`, else all content.

An answer the template did not open (held to a grammar from its first token, no generation prompt, or continuing the
last message, whose text is read first) follows qwen3's rule under either parser. A grammar holds only the answer
after `</think>` (`after_reasoning`): the reasoning before it is free, as vLLM's.

`ThinkStream` splits text as it streams, in any pieces: what a whole answer gives is what its pieces give.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from engine import StructuredOutput

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"

Kind = Literal["reasoning", "content"]
Part = tuple[Kind, str, int]


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could begin `tag` (held back: the tag may be coming)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ThinkStream:
    """An answer's text, fed in pieces, as parts: `(kind, text, end)`, `end` where in the answer (characters fed
    so far) the part's text ends, which places each token's logprobs with the part its text is in."""

    def __init__(self, parser: str, *, opened: bool = True, prefix: str = "") -> None:
        """`opened`: the answer starts where the chat template left it (false for an answer held to a grammar from
        its first token, or one continuing the last message: no template opened `<think>` for it, so its reasoning
        is only what it opens itself, whatever the parser); `prefix`: the text of the message it continues (read
        first, which decides where the answer starts: in reasoning, or not; it does not count in `end`)."""
        assert parser in PARSERS, parser
        # where an answer that does not open <think> starts
        self.first: Kind = "reasoning" if parser == "deepseek_r1" and opened else "content"
        self.state: Literal["start", "reasoning", "content"] = "start"
        self.lead: list[str] = []  # the answer's opening whitespace (before its first tag is known)
        self.head = ""  # then the opening's first characters, as many as could begin <think>
        self.buf = ""  # text not yet given out: the start of a closing tag, once the opening is known
        self.fed = 0  # characters fed
        self.closed = False  # the answer (not the prefix) closed a reasoning
        if prefix:  # (its characters then sit before 0: what of them is still held back is not given out again)
            self.feed(prefix)
            self.fed, self.closed = 0, False

    def feed(self, text: str) -> list[Part]:
        return _answers(self._feed(text))

    def feed_echo(self, text: str) -> list[Part]:
        """The echo an answer starts with (the continued message, given back): fed as the answer's, but a reasoning
        it closes is not the answer's to count."""
        parts = self.feed(text)
        self.closed = False
        return parts

    def end(self) -> list[Part]:
        """What was held back when the answer ended: an opening that never became a tag is the answer's (where it
        starts), as is an unfinished closing tag."""
        return _answers(self._end())

    def reasoning_tokens(self, watched: int | None, tokens: int) -> int:
        """How many of the answer's `tokens` are its reasoning's, once it ended: those up to the end of its closing tag
        (`watched`: the tokens up to the first `</think>` in the answer's text), all if it is reasoning to its end,
        none if it has none."""
        if self.closed:
            return tokens if watched is None else watched
        thinking = self.state == "reasoning" or (self.state == "start" and self.first == "reasoning")
        return tokens if thinking and self.fed > 0 else 0

    def _feed(self, text: str) -> list[Part]:
        self.fed += len(text)
        out: list[Part] = []
        if self.state == "start":
            if not self.head:  # (the whitespace apart, so a long run of it is not stripped again and again)
                body = text.lstrip()
                self.lead.append(text[: len(text) - len(body)])
                text = body
            self.head += text
            if len(self.head) < len(START) and START.startswith(self.head):
                return out  # (all whitespace, or the opening tag's start)
            if self.head.startswith(START):
                self.buf, self.state = self.head[len(START):], "reasoning"
            else:
                self.buf, self.state = "".join(self.lead) + self.head, self.first
            self.lead, self.head = [], ""
        else:
            self.buf += text
        if self.state == "reasoning":
            i = self.buf.find(END)
            if i < 0:
                keep = _tag_prefix(self.buf, END)
                if len(self.buf) > keep:
                    out.append(("reasoning", self.buf[: len(self.buf) - keep], self.fed - keep))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if i:
                out.append(("reasoning", self.buf[:i], self.fed - len(self.buf) + i))
            self.closed = self.fed - len(self.buf) + i + len(END) > 0
            self.buf, self.state = self.buf[i + len(END):], "content"
        if self.buf:
            out.append(("content", self.buf, self.fed))
            self.buf = ""
        return out

    def _end(self) -> list[Part]:
        if self.state == "start":
            rest, kind = "".join(self.lead) + self.head, self.first
        else:
            rest, kind = self.buf, self.state
        self.lead, self.head, self.buf = [], "", ""
        return [(kind, rest, self.fed)] if rest else []


def _answers(parts: list[Part]) -> list[Part]:
    """The parts less the characters of the continued message (before 0): each part's text is the answer's (less its
    tags) just before its end."""
    return [(kind, text[max(0, len(text) - end):], end) for kind, text, end in parts if end > 0]


def split(parser: str, text: str, echo: str = "", **kwargs: Any) -> tuple[str | None, str, ThinkStream]:
    """A whole answer's reasoning (None if it has none) and content, and the stream that split it (`echo`: the text it
    starts with, given back, `ThinkStream.feed_echo`; `kwargs`: ThinkStream's)."""
    stream = ThinkStream(parser, **kwargs)
    parts = (stream.feed_echo(echo) if echo else []) + stream.feed(text) + stream.end()
    reasoning = "".join(t for kind, t, _ in parts if kind == "reasoning")
    return reasoning or None, "".join(t for kind, t, _ in parts if kind == "content"), stream


def after_reasoning(parser: str | None, so: StructuredOutput) -> StructuredOutput:
    """The structured output of an answer after a generation prompt, as vLLM's holds a reasoning model's: only the
    text after `</think>`; under deepseek_r1 (whose template opened `<think>`) the reasoning before it is free, under
    qwen3 only a reasoning the answer opens with `<think>` (else it is held from its start); a grammar that may itself
    begin with `<think>` holds it whole (engine/structured.py `opens`). Without a parser, all of it."""
    if parser == "deepseek_r1":
        return replace(so, after=END)
    return replace(so, after=END, opens=START) if parser == "qwen3" else so
