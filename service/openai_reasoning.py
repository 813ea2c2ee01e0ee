"""A reasoning model's answer split into its reasoning and its content, as vLLM's `--reasoning-parser` splits it.

Reasoning models write their thinking between `<think>` and `</think>` before the answer (their tokenizers show those
tags as text). Two conventions, by the server's `--reasoning-parser`:

- `deepseek_r1` (DeepSeek-R1 and its distills, Qwen3's thinking-only releases): the chat template opens `<think>` in
  the prompt, so the answer starts in its reasoning (a `<think>` the model writes anyway is dropped) and its content
  starts after `</think>`; an answer that never closes it is all reasoning;
- `qwen3` (Qwen3's hybrid models, whose reasoning `enable_thinking: false` turns off): the answer is reasoning only if
  it starts with `<think>`, else all content.

`ThinkStream` splits text as it streams, in any pieces: what a whole answer gives is what its pieces give.
"""
from __future__ import annotations

from typing import Literal

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"

Part = tuple[Literal["reasoning", "content"], str]


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could begin `tag` (held back: the tag may be coming)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ThinkStream:
    def __init__(self, parser: str) -> None:
        assert parser in PARSERS, parser
        self.parser = parser
        self.state: Literal["start", "reasoning", "content"] = "start"
        self.buf = ""  # text not yet given out: the answer's opening (before its first tag is known), or a tag's start

    def feed(self, text: str) -> list[Part]:
        self.buf += text
        out: list[Part] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if len(head) < len(START) and START.startswith(head):
                return out  # (all whitespace, or the opening tag's start)
            if head.startswith(START):
                self.buf, self.state = head[len(START):], "reasoning"
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            i = self.buf.find(END)
            if i < 0:
                keep = _tag_prefix(self.buf, END)
                if len(self.buf) > keep:
                    out.append(("reasoning", self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if i:
                out.append(("reasoning", self.buf[:i]))
            self.buf, self.state = self.buf[i + len(END):], "content"
        if self.buf:
            out.append(("content", self.buf))
            self.buf = ""
        return out

    def end(self) -> list[Part]:
        """What was held back when the answer ended: an opening that never became a tag is the answer's (reasoning
        for deepseek_r1, else content), as is an unfinished closing tag."""
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if self.state == "start":
            return [("reasoning" if self.parser == "deepseek_r1" else "content", rest)]
        return [(self.state, rest)]


def split(parser: str, text: str) -> tuple[str | None, str]:
    """A whole answer's reasoning (None if it has none) and content."""
    stream = ThinkStream(parser)
    parts = stream.feed(text) + stream.end()
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    return reasoning or None, "".join(t for kind, t in parts if kind == "content")
