"""Incremental detokenization with stop strings.

Emits text that never ends in a split UTF-8 character (decoded text ending in U+FFFD waits for
the next token) and never shows any part of a matched stop string: the longest tail of the text
that could still begin a stop string is held back until it is decided.

A fast tokenizer's text comes from its own `DecodeStream` (tokenizers >= 0.21: the same prefix/read-offset
algorithm as below, in Rust, one call a token instead of two decodes and their slices); any other tokenizer, or
a stream that gives up (tokenizers raises when a decoded prefix is not a prefix of the longer decode), decodes
here in Python.
"""
from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

CONTEXT_TOKENS = 6  # prompt tokens decoded along with the output, so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's tokenizers.Tokenizer
        self.stream = _stream(self.backend, self.ids) if self.backend is not None else None
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.first_chars = {s[0] for s in stop}
        self.text = ""  # the completion text so far (cut at a matched stop string)
        self.emitted = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:  # a fast tokenizer: what its decode calls, without transformers' wrapping
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> bool:
        """Appends one token; returns True when a stop string matched (the text is then final)."""
        self.ids.append(token_id)
        if self.stream is not None:
            try:
                new = self.stream.step(self.backend, token_id)
            except Exception:  # NOTE: an invalid prefix (or id): this request decodes in Python from here on
                self.stream = None
            else:
                if new is None:
                    return False
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)  # what flush starts from
                return self._extend(new)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence (or nothing printable) so far
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._extend(full[len(prefix) :])

    def flush(self) -> bool:
        """At the end: keeps the bytes still waiting for the rest of a character (stop strings apply)."""
        if self.read_offset >= len(self.ids):
            return False
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._extend(full[len(prefix) :])

    def _extend(self, new_text: str) -> bool:
        start = len(self.text)
        self.text += new_text
        if self.stop:
            window = max(0, start - self.max_stop + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, window)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return True
        return False

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        text, n = self.text, len(self.text)
        # NOTE: only tails starting with some stop's first character can match: O(max_stop) probes at worst.
        for p in range(max(0, n - self.max_stop + 1), n):
            if text[p] in self.first_chars and any(s.startswith(text[p:]) and len(s) > n - p for s in self.stop):
                return n - p
        return 0

    def delta(self, finished: bool) -> str:
        """New text safe to show now; everything that is left once `finished`."""
        if not self.stop:  # nothing is ever held back
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out
        end = len(self.text) if finished else len(self.text) - self._held_back()
        out = self.text[self.emitted : max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        return out


def _stream(backend, context: list[int]):
    """A DecodeStream primed with `context`: its text is the prefix the first token's text is cut from. Not for a
    context ending mid-character (a prompt given as token ids): the stream would not take its text as the prefix,
    and the first delta would repeat it."""
    if DecodeStream is None or (context and backend.decode(context, skip_special_tokens=True).endswith("\ufffd")):
        return None
    try:
        return DecodeStream(ids=context, skip_special_tokens=True)
    except TypeError:  # tokenizers 0.21's cannot be primed: decoded in Python
        return None
