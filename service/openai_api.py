"""OpenAI-compatible HTTP: `/v1/chat/completions`, `/v1/completions` (JSON or SSE) and `/v1/models`.

Errors use OpenAI's `{"error": {message, type, param, code}}` shape; every 400 carries a `code` (docs/protocol.md
§10). A client that disconnects aborts its request (and frees its KV cache) whether it was streaming or waiting
for the JSON. Parameters that would change the output and are not implemented are refused, never ignored.
"""
from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service import json_guard
from service.handle import GenerateRequest, RequestError, RequestHandle
from service.protocol import StopString
from service.openai_render import ChatRender, CompletionRender, Render

if TYPE_CHECKING:
    from service.app import Service

_STATUS = {"invalid_message": 400, "prompt_too_long": 400, "overloaded": 429, "internal": 500}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "server_overloaded", 500: "server_error",
         503: "service_unavailable"}
# Retry-After: a full queue drains within seconds; a loading model or a restarting server takes longer.
RETRY_AFTER_S = {429: 1, 503: 5}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error_body(status: int, message: str, type_: str | None, param: str | None, code: str | None) -> dict[str, Any]:
    if status == 400 and code is None:
        code = "invalid_message"  # NOTE: the one default of the 400 scheme (docs/protocol.md §10)
    return {"error": {"message": message, "type": type_ or _TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, type_: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    headers = dict(headers or {})
    if status in RETRY_AFTER_S:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S[status]))
    return Response(msgspec.json.encode(_error_body(status, message, type_, param, code)), status_code=status,
                    media_type="application/json", headers=headers)


def _from_request_error(e: RequestError) -> HTTPError:
    code = "context_length_exceeded" if e.code == "prompt_too_long" else e.code
    return HTTPError(_STATUS.get(e.code, 500), e.message, code=code)


def _failure(h: RequestHandle) -> HTTPError | None:
    """Why a request ended without an OpenAI answer: its error, or the server cancelled it (at shutdown).

    A cancel is an error here, not a finish_reason: OpenAI has none for it, and "stop" or "length" would
    pass a cut-off text off as an answer. (A cancel because the client left is never rendered: nobody reads.)
    """
    if h.error is not None:
        return _from_request_error(h.error)
    if h.finish_reason == "abort":
        return HTTPError(503, "the server cancelled this request before it finished (it is shutting down); "
                              "retry shortly")
    return None


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
    # not implemented, and each would change the output: refused by `_refuse_unsupported`, never ignored
    logit_bias: Any = None
    response_format: Any = None
    guided_json: Any = None  # vLLM's guided decoding
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

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
    tools: Any = None  # not implemented, see _Common
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None


class CompletionRequest(_Common):
    prompt: str | list[Any] = ""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# parameter -> (the values that leave the output as Sluice makes it, besides null or leaving it out; what is missing)
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": (([],), "no tool calling"),
    "functions": (([],), "no tool calling"),
    "tool_choice": (("none", "auto"), "no tool calling"),
    "function_call": (("none", "auto"), "no tool calling"),
    "response_format": (({"type": "text"},), 'no structured output: only {"type": "text"}'),
    "guided_json": ((), "no guided decoding"),
    "guided_regex": ((), "no guided decoding"),
    "guided_choice": ((), "no guided decoding"),
    "guided_grammar": ((), "no guided decoding"),
    "logit_bias": (({},), "no logit bias"),
    "audio": ((), "text output only"),
    "modalities": ((["text"],), "text output only"),
    "echo": ((False,), "the prompt is not echoed"),
    "suffix": ((), "no text insertion"),
    "best_of": ((1,), "one completion per request"),
}


def _refuse_unsupported(body: _Common) -> None:
    for name, (neutral, missing) in _UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and value not in neutral:
            raise HTTPError(400, f"`{name}` is not supported by this server ({missing}); leave it out",
                            param=name, code="unsupported_parameter")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(body.messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise HTTPError(400, f"messages[{i}].role {m.role!r} is not supported; use system, user or assistant",
                            param=f"messages[{i}].role",
                            code="unsupported_parameter" if m.role in ("tool", "function") else "invalid_message")
        if isinstance(m.content, list):
            if any(p.type != "text" for p in m.content):
                raise HTTPError(400, f"messages[{i}].content: only text parts are supported",
                                param=f"messages[{i}].content", code="unsupported_parameter")
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
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body over {limit} bytes (--max-message-bytes)")
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-body (or closed by --timeout-body): the transport logs it, nobody reads this
        raise HTTPError(499, "the client disconnected before sending the whole body") from None
    data = b"".join(chunks)
    started = time.perf_counter()
    try:
        return _decode_body(data, struct)
    finally:  # a peer whose bodies keep the loop busy waits for its answers (service/budget.py)
        peer = request.client.host if request.client else "-"
        if (wait := request.app.state.service.http_budgets.charge(peer, time.perf_counter() - started)) > 0:
            await asyncio.sleep(wait)


def _decode_body(data: bytes, struct: type[Struct]) -> Any:
    if (too_deep := json_guard.depth_error(data)) is not None:  # before msgspec recurses into it
        raise HTTPError(400, f"request body refused: {too_deep}", code="invalid_json")
    try:
        return msgspec.json.decode(data, type=struct)
    except msgspec.ValidationError as e:
        raise HTTPError(400, f"invalid request: {e}", param=_param_of(str(e)), code="invalid_message") from None
    except msgspec.DecodeError as e:
        if (surrogate := json_guard.surrogate_error(data)) is not None:
            raise HTTPError(400, f"invalid request: {surrogate}", code="invalid_message") from None
        raise HTTPError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _param_of(message: str) -> str | None:
    """OpenAI's `param` from a msgspec error: `messages[0].role` for "... - at `$.messages[0].role`"."""
    at, missing = _AT.search(message), _MISSING.search(message)
    return ".".join(m.group(1) for m in (at, missing) if m and m.group(1)) or None


def _check_common(svc: Service, body: _Common) -> None:
    if body.model != svc.model_name:
        raise HTTPError(404, f"The model `{body.model}` does not exist; this server serves `{svc.model_name}`.",
                        param="model", code="model_not_found")
    if body.n != 1:
        raise HTTPError(400, "only n=1 is supported; send n separate requests instead", param="n",
                        code="unsupported_parameter")
    _refuse_unsupported(body)
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
                              logprobs=(body.top_logprobs or 0) if body.logprobs else None, api="chat",
                              fit_max_tokens=False)  # as OpenAI: more than the context leaves is a 400
        render = ChatRender(svc.model_name, body.logprobs)
        return await _generate(request, svc, req, render, body)
    except HTTPError as e:
        return error_response(e.status, e.message, param=e.param, code=e.code)


async def completions(request: Request) -> Response:
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, CompletionRequest, svc.config.max_message_bytes)
        _check_common(svc, body)
        req = GenerateRequest(prompt=_completion_prompt(body), chat=False, sampling=body.sampling(),
                              max_tokens=body.max_tokens or 16, logprobs=body.logprobs, api="completions",
                              fit_max_tokens=body.max_tokens is None)  # the default 16 fits; one asked for must
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
        if (failure := _failure(handle)) is not None:
            raise failure
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
    if (e := _failure(handle)) is not None:
        yield _event(_error_body(e.status, e.message, None, e.param, e.code))
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
