"""Incremental detokenization with stop strings.

Emits text that never ends in a split UTF-8 character (decoded text ending in U+FFFD waits for
the next token) and never shows any part of a matched stop string: the longest tail of the text
that could still begin a stop string is held back until it is decided.
"""
from __future__ import annotations

CONTEXT_TOKENS = 6  # prompt tokens decoded along with the output, so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.first_chars = {s[0] for s in stop}
        self.text = ""  # the completion text so far (cut at a matched stop string)
        self.emitted = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if backend is not None:  # a fast tokenizer: what its decode calls, without transformers' per-call wrapping
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> bool:
        """Appends one token; returns True when a stop string matched (the text is then final)."""
        self.ids.append(token_id)
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
        end = len(self.text) if finished else len(self.text) - self._held_back()
        out = self.text[self.emitted : max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        return out
