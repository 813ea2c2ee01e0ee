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

import json

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

CONTEXT_TOKENS = 6  # prompt tokens decoded along with the output, so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's tokenizers.Tokenizer
        self.stream = _stream(self.backend, self.ids) if self.backend is not None else None
        self.stop = stop
        self.include_stop = include_stop  # a matched stop string stays at the end of the text
        self.max_stop = max((len(s) for s in stop), default=0)
        self.first_chars = {s[0] for s in stop}
        # the completion's text (cut at a matched stop string) is kept from character `base` on: what is not handed
        # out yet and, with stop strings, the max_stop - 1 characters before it, where a stop string that later text
        # completes may begin. Never all of it: appending to a string that grows with the output costs a copy of
        # it per token (~17 us a token at 150,000 characters).
        self.buf = ""
        self.base = 0
        self.emitted = 0  # characters handed out

    @property
    def num_chars(self) -> int:
        """Characters of text so far."""
        return self.base + len(self.buf)

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:  # a fast tokenizer: what its decode calls, without transformers' wrapping
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int, stops: bool = True) -> bool:
        """Appends one token; returns True when a stop string matched (the text is then final). `stops` False: the
        token's text is not searched for stop strings (one of the first `min_tokens`)."""
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
                return self._extend(new, stops)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence (or nothing printable) so far
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._extend(full[len(prefix) :], stops)

    def flush(self, stops: bool = True) -> bool:
        """At the end: keeps the bytes still waiting for the rest of a character (stop strings apply, as to the
        last token's text, by `stops`)."""
        if self.read_offset >= len(self.ids):
            return False
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._extend(full[len(prefix) :], stops)

    def _extend(self, new_text: str, stops: bool) -> bool:
        """`new_text` onto the text; with `stops`, the first stop string that ends in it cuts the text (one that ends
        before it is in text never searched: the first `min_tokens`')."""
        start = len(self.buf)  # (a match begins after what was handed out: `delta` holds back any stop's prefix)
        self.buf += new_text
        if self.stop and stops:
            hits = [(i, len(s)) for s in self.stop if (i := self.buf.find(s, max(0, start - len(s) + 1))) >= 0]
            if hits:
                i, n = min(hits)  # the first match (the shortest, of those starting there)
                self.buf = self.buf[: i + n if self.include_stop else i]
                return True
        return False

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text, n = self.buf, len(self.buf)
        # NOTE: only tails starting with some stop's first character can match: O(max_stop) probes at worst.
        for p in range(max(0, n - self.max_stop + 1), n):
            if text[p] in self.first_chars and any(s.startswith(text[p:]) and len(s) > n - p for s in self.stop):
                return n - p
        return 0

    def delta(self, finished: bool) -> str:
        """New text safe to show now; everything that is left once `finished`."""
        at = self.emitted - self.base
        if not self.stop:  # nothing is ever held back, nor kept
            out, self.base, self.buf = self.buf[at:], self.num_chars, ""
            self.emitted = self.base
            return out
        end = len(self.buf) if finished else len(self.buf) - self._held_back()
        out = self.buf[at : max(end, at)]
        self.emitted += len(out)
        keep = max(0, self.emitted - self.base - (self.max_stop - 1))
        self.buf, self.base = self.buf[keep:], self.base + keep
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


class TokenText:
    """One token alone, for logprobs: its own bytes (`bytes`, which may end or start mid-character: a character
    split over tokens is the concatenation of their bytes, as OpenAI's `bytes` field promises) and a name (`name`: its
    text, with any bytes that are not whole UTF-8 characters written `\\xNN`). Decoding the token alone instead gives
    U+FFFD for every such piece, so different tokens would look the same.

    Read from the fast tokenizer's vocabulary: byte-level pieces (GPT-2's alphabet: Llama 3, Qwen, this project's
    tokenizers) map back to bytes, SentencePiece-style byte fallback pieces (`<0xE2>`) are that byte and `▁` a space;
    other added tokens are their content. Special tokens, which the text never shows, have no bytes and are named by
    their content (`<|im_end|>`). Anything else falls back to decoding the token alone."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        kinds = _decoder_kinds(backend.decoder.__getstate__()) if backend is not None and backend.decoder else set()
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self.metaspace = bool(kinds & {"Metaspace", "Replace"})
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.added = set(added)
        # the text never shows these (skip_special_tokens): no bytes, named by their content
        self.special = {i: t.content for i, t in added.items() if getattr(t, "special", False)}
        self._bytes: dict[int, bytes] = {}
        self.frozen = False
        self.names: list[str] = []  # once frozen (`freeze`), every id's name and bytes
        self.raw: list[bytes] = []

    def freeze(self, size: int = 0) -> TokenText:
        """Reads every token's name and bytes now, for ids up to `size` (a model's vocabulary, which may have rows past
        the tokenizer's: they have no bytes, as decoding them gives no text) or the tokenizer's last: a 128k
        vocabulary takes ~0.2 s and ~13 MB. From then on no call touches the tokenizer, so any thread may name tokens
        while another tokenizes with it (a fast tokenizer's Rust object refuses a read while a call elsewhere holds it
        mutably), and `names` / `raw` are lists to index (service/handle.py names a stream's logprobs on the loop)."""
        n = max(size, len(self.tokenizer), max(self.added, default=-1) + 1)
        self.raw = [self._read(i, p) for i, p in enumerate(self.tokenizer.convert_ids_to_tokens(list(range(n))))]
        self.names = [self.special[i] if i in self.special else b.decode("utf-8", "backslashreplace")
                      for i, b in enumerate(self.raw)]
        self.frozen = True
        return self

    def bytes(self, token_id: int) -> bytes:
        if self.frozen:
            return self.raw[token_id] if token_id < len(self.raw) else b""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._read(token_id, self.tokenizer.convert_ids_to_tokens(token_id))
        return b

    def name(self, token_id: int) -> str:
        if self.frozen:
            return self.names[token_id] if token_id < len(self.names) else ""
        if token_id in self.special:
            return self.special[token_id]
        return self.bytes(token_id).decode("utf-8", "backslashreplace")

    def _read(self, token_id: int, piece: str | None) -> bytes:
        """`piece`: the tokenizer's for the id (None past its vocabulary)."""
        if token_id in self.special:
            return b""
        if piece is not None and token_id not in self.added:
            if self.byte_level and all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
            if self.byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if self.metaspace:
                return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id]).encode()


def _decoder_kinds(state: bytes | str) -> set[str]:
    """The `type`s of a tokenizers decoder (its JSON state), those inside a `Sequence` included."""
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(state))
    return found


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each character of a byte-level piece stands for. Printable
    Latin-1 bytes stand for themselves; the other 68 are written as the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(rest)}}


_BYTE_OF = _byte_alphabet()
