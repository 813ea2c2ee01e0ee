"""Checks on untrusted JSON that msgspec does not make: nesting depth (before decoding) and unpaired surrogates.

msgspec decodes recursively: a 2 KB document nested 1,000 deep raises RecursionError. `depth_error`
refuses anything nested deeper than `MAX_DEPTH` first, in C-speed passes, so no decoder ever recurses far.
"""
from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate

MAX_DEPTH = 64  # arrays and objects; the protocol's own frames nest 3 deep, OpenAI bodies rarely past 10

_OPEN_CLOSE = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_QUOTES_OR_BRACKETS = bytes(b for b in range(256) if b not in b'"[]{}')
# `\uXXXX` escapes of UTF-16 surrogates, each after a whole (even) run of backslashes so that it really
# begins an escape: `\\ud800` is an escaped backslash and the text "ud800", not a surrogate.
_ESCAPE_START = rb"(?<!\\)(?P<pre>(?:\\\\)*)"
_HIGH = rb"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_SURROGATES = re.compile(_ESCAPE_START + rb"(?:" + _HIGH + _LOW + rb"|(?P<lone>" + _HIGH + rb"|" + _LOW + rb"))")


class TooDeep(ValueError):
    """`loads`' refusal of a text nested deeper than MAX_DEPTH; its message is `depth_error`'s."""


def loads(text: str) -> object:
    """JSON text that is not a body (a field holding JSON as a string, a model's output), decoded: the body's depth
    check never looked inside it. Raises `TooDeep`, or ValueError if it is not JSON."""
    if (too_deep := depth_error(text)) is not None:
        raise TooDeep(too_deep)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (RecursionError: a parser deeper than the check's bound; kept safe)
        raise ValueError("not JSON") from None


def _bytes(data: str | bytes) -> bytes:
    return data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data


def depth_error(data: str | bytes) -> str | None:
    """Why `data` must not be decoded (nested deeper than MAX_DEPTH), or None.

    Exact for valid JSON; for invalid JSON it bounds the depth a left-to-right parser reaches before its
    first syntax error, so a None here means no decoder recurses deeper than MAX_DEPTH.
    """
    if isinstance(data, str):
        opening = data.count("[") + data.count("{")
    else:
        opening = data.count(b"[") + data.count(b"{")
    if opening <= MAX_DEPTH:  # the common case: too few brackets, even counting those inside strings
        return None
    # Drop escaped backslashes, then escaped quotes: every `"` left delimits a string, and the text
    # outside strings is every other piece between them. Only quotes and brackets matter; two adjacent
    # quotes enclose no bracket, so dropping them keeps every other quote's parity and the answer exact
    # (a 1 MB frame of 28,000 small objects shrinks to its brackets: ~3 ms, not ~15).
    unescaped = _bytes(data)
    if b"\\" in unescaped:
        unescaped = unescaped.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = unescaped.translate(None, _NOT_QUOTES_OR_BRACKETS).replace(b'""', b"")
    brackets = b"".join(shape.split(b'"')[::2]).translate(_OPEN_CLOSE, _NOT_BRACKETS)
    if max(accumulate(array("b", brackets)), default=0) <= MAX_DEPTH:
        return None
    return f"JSON nested deeper than {MAX_DEPTH} levels"


def surrogate_error(data: str | bytes) -> str | None:
    """After msgspec refused `data`: the explanation if a string holds an unpaired UTF-16 surrogate escape.

    msgspec refuses those (rightly: they are not Unicode text) but calls it "Input data was truncated"
    or "invalid utf-16 surrogate pair"; this names the escape and where it is.
    """
    for m in _SURROGATES.finditer(_bytes(data)):
        if m.group("lone"):
            return (f"a string holds an unpaired UTF-16 surrogate ({m.group('lone').decode()} at byte "
                    f"{m.start('lone')}), which is not Unicode text; escape a character as a high and low "
                    "surrogate pair, or send it as UTF-8")
    return None


def without_unpaired_surrogates(data: str | bytes, replacement: bytes = b"\\ufffd") -> bytes:
    """`data` with each unpaired surrogate escape replaced by `replacement` (an escape of a valid character), to read
    the rest of a refused document."""
    return _SURROGATES.sub(lambda m: m.group("pre") + replacement if m.group("lone") else m.group(0), _bytes(data))
