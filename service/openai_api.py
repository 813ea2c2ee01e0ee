"""OpenAI-compatible HTTP: `/v1/chat/completions`, `/v1/completions` (JSON or SSE) and `/v1/models`.

Errors use OpenAI's `{"error": {message, type, param, code}}` shape. A client that disconnects
aborts its request (and frees its KV cache) whether it was streaming or waiting for the JSON.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.handle import GenerateRequest, RequestError, RequestHandle
from service.protocol import StopString
from service.openai_render import ChatRender, CompletionRender, Render

if TYPE_CHECKING:
    from service.app import Service

_STATUS = {"invalid_message": 400, "prompt_too_long": 400, "overloaded": 429, "internal": 500}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 429: "server_overloaded", 500: "server_error", 503: "service_unavailable"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None,
                   code: str | None = None) -> Response:
    body = {"error": {"message": message, "type": type_ or _TYPE.get(status, "server_error"),
                      "param": param, "code": code}}
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _from_request_error(e: RequestError) -> HTTPError:
    code = "context_length_exceeded" if e.code == "prompt_too_long" else e.code
    return HTTPError(_STATUS.get(e.code, 500), e.message, code=code)


# ---- request schemas (unknown fields are ignored: OpenAI clients send many) ---------------------
class _ContentPart(Struct):
    type: str
    text: str | None = None


class _Message(Struct):
    role: str
    content: str | list[_ContentPart] | None = None


class _StreamOptions(Struct):
    include_usage: bool = False


class _Common(Struct):
    model: str
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=16)] | None = None  # as docs/protocol.md §3
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    # extensions under vLLM's names, reachable through the openai client's `extra_body`
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool | None = None

    def sampling(self) -> dict[str, Any]:
        names = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "ignore_eos")
        kwargs = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return kwargs


class ChatCompletionRequest(_Common):
    messages: Annotated[list[_Message], Meta(min_length=1)] = []
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class CompletionRequest(_Common):
    prompt: str | list[Any] = ""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(body.messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise HTTPError(400, f"messages[{i}].role {m.role!r} is not supported; use system, user or assistant",
                            param=f"messages[{i}].role")
        if isinstance(m.content, list):
            if any(p.type != "text" for p in m.content):
                raise HTTPError(400, f"messages[{i}].content: only text parts are supported",
                                param=f"messages[{i}].content")
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        out.append({"role": role, "content": content})
    return out


def _completion_prompt(body: CompletionRequest) -> str | list[int]:
    p = body.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise HTTPError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")


async def _read_body(request: Request, struct: type[Struct], limit: int) -> Any:
    if int(request.headers.get("content-length") or 0) > limit:
        raise HTTPError(413, f"request body over {limit} bytes (--max-message-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body over {limit} bytes (--max-message-bytes)")
        chunks.append(chunk)
    try:
        return msgspec.json.decode(b"".join(chunks), type=struct)
    except msgspec.ValidationError as e:
        raise HTTPError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None


def _check_common(svc: Service, body: _Common) -> None:
    if body.model != svc.model_name:
        raise HTTPError(404, f"The model `{body.model}` does not exist; this server serves `{svc.model_name}`.",
                        param="model", code="model_not_found")
    if body.n != 1:
        raise HTTPError(400, "only n=1 is supported; send n separate requests instead", param="n")
    if not svc.accepting:
        raise HTTPError(503, "the server is starting or shutting down; retry shortly")


async def chat_completions(request: Request) -> Response:
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, ChatCompletionRequest, svc.config.max_message_bytes)
        _check_common(svc, body)
        if not body.messages:
            raise HTTPError(400, "messages must hold at least one message", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise HTTPError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        req = GenerateRequest(prompt=_chat_messages(body), chat=True, sampling=body.sampling(),
                              max_tokens=body.max_completion_tokens or body.max_tokens,
                              logprobs=(body.top_logprobs or 0) if body.logprobs else None, api="chat")
        render = ChatRender(svc.model_name, body.logprobs)
        return await _generate(request, svc, req, render, body)
    except HTTPError as e:
        return error_response(e.status, e.message, param=e.param, code=e.code)


async def completions(request: Request) -> Response:
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, CompletionRequest, svc.config.max_message_bytes)
        _check_common(svc, body)
        if body.echo or body.suffix is not None or (body.best_of or 1) != 1:
            raise HTTPError(400, "echo, suffix and best_of>1 are not supported")
        req = GenerateRequest(prompt=_completion_prompt(body), chat=False, sampling=body.sampling(),
                              max_tokens=body.max_tokens or 16, logprobs=body.logprobs, api="completions")
        render = CompletionRender(svc.model_name, body.logprobs is not None)
        return await _generate(request, svc, req, render, body)
    except HTTPError as e:
        return error_response(e.status, e.message, param=e.param, code=e.code)


async def models(request: Request) -> Response:
    svc: Service = request.app.state.service
    card = {"id": svc.model_name, "object": "model", "created": svc.started_at, "owned_by": "sluice",
            "max_model_len": svc.bridge.max_model_len}
    return Response(msgspec.json.encode({"object": "list", "data": [card]}), media_type="application/json")


async def _wait_for(receive: Receive, handle: RequestHandle, event: asyncio.Event,
                    ready: Callable[[RequestHandle], bool]) -> bool:
    """Wait until `ready(handle)`; False if the client disconnected first."""
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        while not ready(handle):
            event.clear()
            waiter = asyncio.ensure_future(event.wait())
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if watcher.done():
                return False
        return True
    finally:
        watcher.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _generate(request: Request, svc: Service, req: GenerateRequest, render: Render, body: _Common) -> Response:
    event = asyncio.Event()
    try:
        handle = svc.bridge.submit(req, event.set)
    except RequestError as e:
        raise _from_request_error(e) from None
    # Streams too wait for the first output, so admission errors still get a real HTTP status.
    ready = (lambda h: h.finished) if not body.stream else (lambda h: h.finished or h.prompt_tokens is not None)
    streaming = False
    try:
        if not await _wait_for(request.receive, handle, event, ready):
            return Response(status_code=499)  # nobody reads it
        if handle.error is not None:
            raise _from_request_error(handle.error)
        if not body.stream:
            return Response(msgspec.json.encode(render.response(handle)), media_type="application/json")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        streaming = True
        return SSEResponse(_sse(render, handle, event, include_usage), lambda: svc.bridge.abort(handle))
    finally:
        # NOTE: whatever ended the wait -- a disconnect (even in the tick the first output came), an error,
        # this task's cancellation -- a request not handed to a stream is aborted here; the stream aborts
        # its own.
        if not streaming and not handle.finished:
            svc.bridge.abort(handle)


async def _sse(render: Render, handle: RequestHandle, event: asyncio.Event, include_usage: bool) -> AsyncIterator[bytes]:
    for chunk in render.stream_start(handle, include_usage):
        yield _event(chunk)
    while True:
        text, _, lps = handle.take()
        if text or lps:
            yield _event(render.stream_delta(text, lps, include_usage))
        if handle.finished:
            break
        event.clear()
        await event.wait()
    if handle.error is not None:
        e = _from_request_error(handle.error)
        yield _event({"error": {"message": e.message, "type": _TYPE.get(e.status, "server_error"),
                                "param": None, "code": e.code}})
    else:
        for chunk in render.stream_end(handle, include_usage):
            yield _event(chunk)
    yield b"data: [DONE]\n\n"


def _event(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class SSEResponse(Response):
    """Server-sent events that stop, and call `on_disconnect`, as soon as the client goes away.

    Starlette's StreamingResponse only notices a gone client at its next write (ASGI spec >= 2.4),
    which for a request still queued could be much later; this one listens while it streams.
    """

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        # NOTE: no Response.__init__: it would declare `content-length: 0` for the missing body.
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.chunks = chunks
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            failed = pump.done() and not pump.cancelled() and pump.exception() is not None
            if not pump.done() or pump.cancelled() or failed:
                pump.cancel()
                self.on_disconnect()  # the client is gone (or the write failed): stop generating for it
        if failed and not isinstance(pump.exception(), OSError):
            raise pump.exception()  # type: ignore[misc]

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
