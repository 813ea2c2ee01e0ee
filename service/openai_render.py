"""OpenAI response bodies and stream chunks for chat and text completions; one renderer per request.

Pure functions of a finished (or streaming) `RequestHandle`: no I/O, so the shapes are testable alone.
"""
from __future__ import annotations

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
        def entry(tok: str, lp: float) -> dict[str, Any]:
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(tt, tl) for tt, tl in top]}
                            for t, lp, top in lps], "refusal": None}

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

    def _lp(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        offsets = []
        for tok, _, _ in lps:
            offsets.append(self.offset)
            self.offset += len(tok)
        return {"tokens": [t for t, _, _ in lps], "token_logprobs": [lp for _, lp, _ in lps],
                "top_logprobs": [dict(top) for _, _, top in lps], "text_offset": offsets}

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
