"""OpenAI response bodies and stream chunks for chat and text completions; one renderer per request.

Pure functions of a finished (or streaming) `RequestHandle`: no I/O, so the shapes are testable alone.
"""
from __future__ import annotations

import codecs
import time
import uuid
from typing import Any, Protocol

from service.handle import RequestHandle, TokenLogprobs


def usage(h: RequestHandle) -> dict[str, Any]:
    prompt = h.prompt_tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": h.completion_tokens,
            "total_tokens": prompt + h.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": h.cached_tokens}}


def _finish_reason(h: RequestHandle) -> str:
    """OpenAI's value. An aborted request never gets here: openai_api answers it with an error."""
    assert h.finish_reason in ("stop", "length"), f"request {h.request_id} finished with {h.finish_reason!r}"
    return h.finish_reason


class Render(Protocol):
    def response(self, h: RequestHandle) -> dict[str, Any]: ...
    def stream_start(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]: ...
    def stream_delta(self, text: str, lps: list[TokenLogprobs], include_usage: bool) -> dict[str, Any]: ...
    def stream_end(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]: ...


class _Base:
    ID_PREFIX = ""
    CHUNK_OBJECT = ""

    def __init__(self, model: str, logprobs: bool) -> None:
        self.id = f"{self.ID_PREFIX}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool, usage_: Any = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.CHUNK_OBJECT, "created": self.created, "model": self.model,
                 "choices": choices}
        if include_usage:
            chunk["usage"] = usage_
        return chunk


class ChatRender(_Base):
    ID_PREFIX, CHUNK_OBJECT = "chatcmpl", "chat.completion.chunk"

    @staticmethod
    def _lp(lps: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(tok: str, raw: bytes, lp: float) -> dict[str, Any]:
            return {"token": tok, "logprob": lp, "bytes": list(raw)}

        return {"content": [{**entry(t, b, lp), "top_logprobs": [entry(*alt) for alt in top]}
                            for t, b, lp, top in lps], "refusal": None}

    def response(self, h: RequestHandle) -> dict[str, Any]:
        text, _, lps = h.take()
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": self._lp(lps) if self.logprobs else None,
                             "finish_reason": _finish_reason(h)}],
                "usage": usage(h)}

    def stream_start(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], include_usage)]

    def stream_delta(self, text: str, lps: list[TokenLogprobs], include_usage: bool) -> dict[str, Any]:
        return self._chunk([{"index": 0, "delta": {"content": text},
                             "logprobs": self._lp(lps) if self.logprobs else None, "finish_reason": None}],
                           include_usage)

    def stream_end(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        chunks = [self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(h)}],
                              include_usage)]
        if include_usage:
            chunks.append(self._chunk([], True, usage(h)))
        return chunks


class CompletionRender(_Base):
    ID_PREFIX, CHUNK_OBJECT = "cmpl", "text_completion"

    def __init__(self, model: str, logprobs: bool) -> None:
        super().__init__(model, logprobs)
        self.offset = 0  # text_offset of the next token, across stream chunks
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # the text the tokens' bytes have made so far

    def _lp(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        """`text_offset`: where in the text each token's bytes begin; a token that continues a character split
        over tokens points at that character, whose text its last piece completes."""
        offsets, tops = [], []
        for _, raw, _, top in lps:
            offsets.append(self.offset + self._pending_chars(raw))
            self.offset += len(self.utf8.decode(raw))
            alts: dict[str, float] = {}
            for name, _, lp in top:  # (names rarely repeat; the likelier entry is kept)
                alts.setdefault(name, lp)
            tops.append(alts)
        return {"tokens": [t for t, _, _, _ in lps], "token_logprobs": [lp for _, _, lp, _ in lps],
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

    def response(self, h: RequestHandle) -> dict[str, Any]:
        text, _, lps = h.take()
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": self._lp(lps) if self.logprobs else None,
                             "finish_reason": _finish_reason(h)}],
                "usage": usage(h)}

    def stream_start(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        return []

    def stream_delta(self, text: str, lps: list[TokenLogprobs], include_usage: bool) -> dict[str, Any]:
        return self._chunk([{"index": 0, "text": text, "logprobs": self._lp(lps) if self.logprobs else None,
                             "finish_reason": None}], include_usage)

    def stream_end(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        chunks = [self._chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": _finish_reason(h)}],
                              include_usage)]
        if include_usage:
            chunks.append(self._chunk([], True, usage(h)))
        return chunks
