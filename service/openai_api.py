"""OpenAI-compatible HTTP: `/v1/chat/completions`, `/v1/completions` (JSON or SSE) and `/v1/models`.

Errors use OpenAI's `{"error": {message, type, param, code}}` shape; every 400 carries a `code` (docs/protocol.md
§10). A client that disconnects aborts its request (and frees its KV cache) whether it was streaming or waiting
for the JSON. Parameters that would change the output and are not implemented are refused, never ignored.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import Struct
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine import SamplingParams
from service.budget import stop_metering
from service.openai_errors import HTTPError, error_response
from service.handle import GenerateRequest, RequestError, RequestHandle, client_of, sampling_params
from service.openai_schema import (
    ChatCompletionRequest, CommonRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest, TokenizeRequest,
    _StreamOptions, chat_messages, completion_prompts, decode_body, refuse_unsupported, template_kwargs,
)
from service import openai_reasoning, openai_tools
from service.openai_render import ChatRender, CompletionRender, Render

if TYPE_CHECKING:
    from service.bridge import EngineBridge
    from service.state import Service

_STATUS = {"invalid_message": 400, "overloaded": 429, "internal": 500}  # prompt_too_long: _from_request_error


def _error(e: HTTPError) -> Response:
    return error_response(e.status, e.message, param=e.param, code=e.code)


def _from_request_error(e: RequestError, prompt_param: str | None = None) -> HTTPError:
    """`prompt_param`: the body field a too-long prompt is named by, as OpenAI does ("messages" or "prompt"); also
    the field at fault for a request the engine refused without naming one (an empty prompt, token ids outside the
    vocabulary, messages the chat template refuses: its sampling values it names)."""
    if e.code == "prompt_too_long":
        return HTTPError(400, e.message, param=e.param or prompt_param, code="context_length_exceeded")
    param = e.param or (prompt_param if e.code == "invalid_message" else None)
    return HTTPError(_STATUS.get(e.code, 500), e.message, param=param, code=e.code)


def _prompt_param(body: CommonRequest) -> str:
    return ("messages" if isinstance(body, ChatCompletionRequest) else "input" if isinstance(body, ResponsesRequest)
            else "prompt")


def _failure(h: RequestHandle, body: CommonRequest) -> HTTPError | None:
    """Why a request ended without an OpenAI answer: its error, or the server cancelled it (at shutdown).

    A cancel is an error here, not a finish_reason: OpenAI has none for it, and "stop" or "length" would
    pass a cut-off text off as an answer. (A cancel because the client left is never rendered: nobody reads.)
    """
    if h.error is not None:
        return _from_request_error(h.error, _prompt_param(body))
    if h.finish_reason == "abort":
        return HTTPError(503, "the server cancelled this request before it finished (it is shutting down); "
                              "retry shortly")
    return None


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
    return decode_body(b"".join(chunks), struct)  # (its loop time charged to the peer: service/budget.py)


_STARTING = "the server is starting or shutting down; retry shortly"


def _check_model(svc: Service, model: str) -> None:
    """The model a request names: 404 unless it is the one served."""
    if not svc.model_name:  # (before the engine is ready, without --served-model-name: no name to compare yet)
        raise HTTPError(503, _STARTING)
    if model != svc.model_name:
        raise HTTPError(404, f"The model `{model}` does not exist; this server serves `{svc.model_name}`.",
                        param="model", code="model_not_found")


def _check_common(svc: Service, body: CommonRequest) -> None:
    _check_model(svc, body.model)
    if body.stream_options is not None and not body.stream:
        raise HTTPError(400, "stream_options is only allowed when stream is true", param="stream_options",
                        code="invalid_message")
    refuse_unsupported(body)
    if body.prompt_logprobs is not None and body.stream:  # (as vLLM)
        raise HTTPError(400, "prompt_logprobs are not available when streaming", param="prompt_logprobs")
    if body.truncate_prompt_tokens == 0:
        raise HTTPError(400, "truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds)",
                        param="truncate_prompt_tokens")
    if not svc.accepting:
        raise HTTPError(503, _STARTING)


async def chat_completions(request: Request) -> Response:
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, ChatCompletionRequest, svc.config.max_message_bytes)
        req, render = chat_request(svc, body, client_of(request))
        return await _generate(request, svc, [req], render, body)
    except RequestError as e:
        return _error(_from_request_error(e))
    except HTTPError as e:
        return _error(e)


def chat_request(svc: Service, body: ChatCompletionRequest, client: str,
                 api: str = "chat") -> tuple[GenerateRequest, ChatRender]:
    """A chat body, checked: the engine request it makes and its renderer (also the Responses API's:
    service/openai_responses.py)."""
    _check_common(svc, body)
    if not body.messages:
        raise HTTPError(400, "messages must hold at least one message", param="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise HTTPError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if body.reasoning_effort not in (None, "none") and svc.config.reasoning_parser is None:  # (as OpenAI's models)
        raise HTTPError(400, "`reasoning_effort` is not supported by this server (its model does not reason: no "
                             "--reasoning-parser); leave it out", param="reasoning_effort", code="unsupported_parameter")
    kwargs = body.sampling_kwargs()
    tools = openai_tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                              svc.config.tool_call_parser if svc.config.enable_auto_tool_choice else None)
    if tools.structured_output is not None:
        if (so := kwargs.get("structured_output")) is not None:
            raise HTTPError(400, f"tool_choice {body.tool_choice if isinstance(body.tool_choice, str) else 'named'} "
                                 f"holds the answer to its calls: it cannot be combined with {so.param}",
                            param="tool_choice")
        kwargs["structured_output"] = tools.structured_output
    if body.prompt_logprobs is not None and (body.n or 1) > 1:
        raise HTTPError(400, "n must be 1 with prompt_logprobs: each choice would compute its prompt again",
                        param="n")
    continue_final = bool(body.continue_final_message)
    add_generation_prompt = body.add_generation_prompt if body.add_generation_prompt is not None else (
        not continue_final)  # (vLLM's default is true, which continue_final_message must turn off)
    if add_generation_prompt and continue_final:
        raise HTTPError(400, "continue_final_message and add_generation_prompt cannot both be true: the last "
                             "message is either continued or followed by a new turn", param="continue_final_message")
    if (so := kwargs.get("structured_output")) is not None and add_generation_prompt:
        kwargs["structured_output"] = openai_reasoning.after_reasoning(svc.config.reasoning_parser, so)
    params = sampling_params(svc.bridge.sampling_defaults, max_tokens=body.max_completion_tokens or body.max_tokens,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None, **kwargs)
    so = params.structured_output  # (one held from its first token: the template opened nothing for it)
    messages = chat_messages(body)
    asked = (body.max_completion_tokens or body.max_tokens) is not None
    req = GenerateRequest(prompt=messages, chat=True, params=params, api=api, client=client,
                          # as OpenAI: more than the context leaves is a 400, if the client asked for it (the
                          # generation config's max_new_tokens, a default, is capped to the context as vLLM caps it)
                          fit_max_tokens=not asked,
                          add_special_tokens=body.add_special_tokens, add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final, truncate_prompt_tokens=_truncation(svc, body),
                          tools=tools.tools, documents=body.documents, template_kwargs=template_kwargs(body))
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else ""
    render = ChatRender(svc.model_name, bool(body.logprobs), echo=echo, token_ids=bool(body.return_tokens_as_token_ids),
                        tools=tools if tools.mode != "none" else None, prompt_logprobs=body.prompt_logprobs,
                        reasoning=svc.config.reasoning_parser,
                        opened=add_generation_prompt and (so is None or bool(so.after)),
                        continued=messages[-1]["content"] or "" if continue_final else None)
    return req, render


async def completions(request: Request) -> Response:
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, CompletionRequest, svc.config.max_message_bytes)
        _check_common(svc, body)
        kwargs, prompts = body.sampling_kwargs(), completion_prompts(body)
        if body.echo and body.logprobs is not None:  # the prompt's tokens' logprobs lead the answer's
            kwargs["prompt_logprobs"] = max(body.logprobs, kwargs.get("prompt_logprobs", 0))
        if "prompt_logprobs" in kwargs and (body.n or 1) > 1:
            raise HTTPError(400, "n must be 1 with prompt logprobs (prompt_logprobs, or echo with logprobs): each "
                                 "choice would compute its prompt again", param="n")
        prompt_only = body.max_tokens == 0  # (vLLM's: the echoed prompt alone, its logprobs scored)
        if prompt_only and not body.echo:
            raise HTTPError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                            param="max_tokens")
        if prompt_only and body.min_tokens:
            raise HTTPError(400, "min_tokens must be 0 with max_tokens 0 (the prompt alone, no token)",
                            param="min_tokens")
        params = sampling_params(svc.bridge.sampling_defaults, max_tokens=1 if prompt_only else body.max_tokens or 16,
                                 logprobs=body.logprobs, **kwargs)
        # an echo without logprobs of token ids, or of the tokens a truncation kept: their text, from the ids
        echo_ids = bool(body.echo) and "prompt_logprobs" not in kwargs
        reqs = [GenerateRequest(prompt=prompt, chat=False, params=params, api="completions", client=client_of(request),
                                add_special_tokens=body.add_special_tokens, truncate_prompt_tokens=_truncation(svc, body),
                                fit_max_tokens=body.max_tokens is None,  # the default 16 fits; one asked for must
                                echo_ids=echo_ids and (not isinstance(prompt, str) or body.truncate_prompt_tokens
                                                       is not None))
                for prompt in prompts]
        render = CompletionRender(svc.model_name, body.logprobs is not None,
                                  token_ids=bool(body.return_tokens_as_token_ids),
                                  echo=[p if isinstance(p, str) else None for p in prompts] if body.echo else None,
                                  prompt_logprobs=body.prompt_logprobs, n=body.n or 1,
                                  top_logprobs=body.logprobs or 0, prompt_only=prompt_only)
        return await _generate(request, svc, reqs, render, body)
    except RequestError as e:
        return _error(_from_request_error(e))
    except HTTPError as e:
        return _error(e)


def _truncation(svc: Service, body: CommonRequest) -> int | None:
    """How many of the prompt's last tokens to keep: -1 is all that leave room for one new token."""
    k = body.truncate_prompt_tokens
    return svc.bridge.max_model_len - 1 if k == -1 else k


def _card(svc: Service) -> dict[str, Any]:
    return {"id": svc.model_name, "object": "model", "created": svc.started_at, "owned_by": "sluice",
            "max_model_len": svc.bridge.max_model_len}


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a prompt's token ids as a completion (`prompt`) or chat completion (`messages`) request would
    make them, their count and the context; with `return_token_strs`, the tokenizer's string of each."""
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, TokenizeRequest, svc.config.max_message_bytes)
        _check_tokenizer(svc, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give a prompt or messages (one of them)", param="prompt")
        if body.chat_template is not None:
            raise HTTPError(400, "`chat_template` is not supported by this server (the model's own chat template "
                                 "only); leave it out", param="chat_template", code="unsupported_parameter")
        if body.messages is not None:
            continue_final = bool(body.continue_final_message)
            req = GenerateRequest(prompt=chat_messages(body), chat=True, params=SamplingParams(), api="tokenize",
                                  client=client_of(request), add_special_tokens=body.add_special_tokens,
                                  add_generation_prompt=(body.add_generation_prompt if body.add_generation_prompt
                                                         is not None else not continue_final),
                                  continue_final_message=continue_final,
                                  tools=openai_tools.plan(body.tools, "none" if body.tools else None, None, None).tools,
                                  documents=body.documents, template_kwargs=template_kwargs(body))
        else:
            req = GenerateRequest(prompt=body.prompt, chat=False, params=SamplingParams(), api="tokenize",
                                  client=client_of(request), add_special_tokens=body.add_special_tokens)
        ids = await svc.bridge.tokenize(req)
        strs = await svc.bridge.token_strs(req.client, ids) if body.return_token_strs else None
        return Response(msgspec.json.encode({"count": len(ids), "max_model_len": svc.bridge.max_model_len,
                                             "tokens": ids, "token_strs": strs}), media_type="application/json")
    except RequestError as e:
        return _error(_from_request_error(e, "messages"))  # (a template's refusal; a prompt's text never fails)
    except HTTPError as e:
        return _error(e)


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: the text of token ids (special tokens written out)."""
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, DetokenizeRequest, svc.config.max_message_bytes)
        _check_tokenizer(svc, body.model)
        text = await svc.bridge.detokenize(client_of(request), body.tokens)
        return Response(msgspec.json.encode({"prompt": text}), media_type="application/json")
    except RequestError as e:
        return _error(_from_request_error(e, "tokens"))
    except HTTPError as e:
        return _error(e)


def _check_tokenizer(svc: Service, model: str | None) -> None:
    if model is not None:
        _check_model(svc, model)
    if not svc.bridge.ready:
        raise HTTPError(503, _STARTING)


async def models(request: Request) -> Response:
    svc: Service = request.app.state.service
    if not svc.bridge.ready:  # (its name and context are the engine's: not known yet, or no longer served)
        return _error(HTTPError(503, _STARTING))
    return Response(msgspec.json.encode({"object": "list", "data": [_card(svc)]}), media_type="application/json")


async def model(request: Request) -> Response:
    """`GET /v1/models/{model}`: OpenAI's "retrieve model"."""
    svc: Service = request.app.state.service
    try:
        if not svc.bridge.ready:
            raise HTTPError(503, _STARTING)
        _check_model(svc, request.path_params["model"])
    except HTTPError as e:
        return _error(e)
    return Response(msgspec.json.encode(_card(svc)), media_type="application/json")


async def _wait_for(receive: Receive, handles: list[RequestHandle], event: asyncio.Event,
                    ready: Callable[[list[RequestHandle]], bool]) -> bool:
    """Wait until `ready(handles)`; False if the client disconnected first."""
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        while not ready(handles):
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


def _choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice `i`'s sampling: a seeded request's choices draw from seeds seed, seed + 1, ... (vLLM's rule), so each
    is reproducible and they differ."""
    return params if params.seed is None or i == 0 else replace(params, seed=(params.seed + i) % 2**63)


async def _generate(request: Request, svc: Service, reqs: list[GenerateRequest], render: Render,
                    body: CommonRequest) -> Response:
    """One engine request per choice (`n` of each prompt of `reqs`, in that order), answered together. A prompt is
    computed once: the scheduler holds a prompt back while another computes the blocks it would take from the prefix
    cache (docs/architecture.md §4)."""
    n = body.n or 1
    if len(reqs) > 1 and len(reqs) * n > (share := svc.bridge.max_queued_per_client):  # (never queued: not a 429)
        raise HTTPError(400, f"{len(reqs)} prompts x n={n} are more choices than the server queues for one client "
                             f"({share}, --max-queued-requests-per-client); split the batch", param="prompt")
    event = asyncio.Event()  # set by every choice's output
    handles: list[RequestHandle] = []
    streaming = False
    try:
        for req in reqs:  # (each prompt tokenized once for its choices)
            try:
                choices = svc.bridge.submit_choices(req, event.set, [_choice_params(req.params, i) for i in range(n)])
                for h in choices:  # (before any output: the bridge pushes none inside `submit`)
                    render.watch(h)
                handles += choices
            except RequestError as e:
                raise _from_request_error(e, _prompt_param(body)) from None
        stop_metering(request.scope)  # (what it costs the loop from here follows its tokens: service/budget.py)

        def failed(hs: list[RequestHandle]) -> bool:  # (a failure ends the wait: the other choices go at once)
            return any(h.finished and _failure(h, body) is not None for h in hs)

        # Streams wait for every prompt's first output (its choices share its prompt and its fate), so admission
        # errors, any prompt's, still get a real HTTP status.
        firsts = handles[::n]
        ready = ((lambda hs: all(h.finished for h in hs) or failed(hs)) if not body.stream else
                 (lambda hs: all(h.started or h.finished for h in firsts) or failed(hs)))
        if not await _wait_for(request.receive, handles, event, ready):
            return Response(status_code=499)
        for h in handles:
            if h.finished and (failure := _failure(h, body)) is not None:
                raise failure
        renders = render.siblings(len(handles))
        client = reqs[0].client
        if not body.stream:
            args = (svc.bridge, render, renders, handles, n)
            # NOTE: logprobs can make a response of thousands of entries (a long prompt's, each with its top 20): it
            # is made on the tokenizer thread, in this client's turn, not on the loop that runs every stream
            heavy = render.logprobs or any(h.prompt_scores is not None for h in handles)
            content = await svc.bridge.off_loop(client, _encoded, *args) if heavy else _encoded(*args)
            return Response(content, media_type="application/json")
        options = body.stream_options if isinstance(body.stream_options, _StreamOptions) else _StreamOptions()
        streaming = True
        return SSEResponse(_sse(renders, handles, n, event, options, body, svc.bridge, client),
                           lambda: _abort(svc, handles))
    finally:
        # NOTE: whatever ended the wait -- a disconnect (even in the tick the first output came), an error,
        # this task's cancellation -- requests not handed to a stream are aborted here; the stream aborts
        # its own.
        if not streaming:
            _abort(svc, handles)


def _abort(svc: Service, handles: list[RequestHandle]) -> None:
    for h in handles:
        if not h.finished:
            svc.bridge.abort(h)


def _encoded(bridge: EngineBridge, render: Render, renders: list[Render], handles: list[RequestHandle],
             n: int) -> bytes:
    """The whole (not streamed) response, its prompt logprobs named."""
    for h in handles:
        bridge.name_prompt_logprobs(h)
    return msgspec.json.encode(render.response(renders, handles, n))


def _prompt_events(bridge: EngineBridge, h: RequestHandle, r: Render, include_usage: bool,
                   continuous: bool) -> list[bytes]:
    """A stream's chunks of its prompt (completions' echo with logprobs), once they came: on the tokenizer thread."""
    bridge.name_prompt_logprobs(h)
    chunks = r.stream_prompt(include_usage)
    return _usage_events(r, h, chunks) if continuous else [r.event(chunk) for chunk in chunks]


def _usage_events(r: Render, h: RequestHandle, chunks: list[dict[str, Any]]) -> list[bytes]:
    """`chunks` as events, each with its choice's usage so far (vLLM's `continuous_usage_stats`)."""
    prompt, completion = h.prompt_tokens or 0, h.completion_tokens
    so_far = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return [r.event({**chunk, "usage": so_far}) for chunk in chunks]


async def _sse(renders: list[Render], handles: list[RequestHandle], n: int, event: asyncio.Event,
               options: _StreamOptions, body: CommonRequest, bridge: EngineBridge,
               client: str) -> AsyncIterator[bytes]:
    """Each choice's chunks as its output comes (a chunk names its choice's `index`), its finish chunk when it
    ends; the usage of all after the last (`include_usage`), and with vLLM's `continuous_usage_stats` each chunk's
    choice's usage so far in the chunk. A choice that fails ends the stream with an error event, and the others
    are aborted. A prompt's logprobs (completions' echo) are named and rendered off the loop, as `_encoded`."""
    include_usage = options.include_usage
    continuous = include_usage and options.continuous_usage_stats
    ev = _usage_events if continuous else lambda r, h, chunks: [r.event(chunk) for chunk in chunks]
    for r, h in zip(renders, handles):
        for e in ev(r, h, r.stream_start(h, include_usage)):
            yield e
    running = dict(zip(handles, renders))
    try:
        while running:
            event.clear()  # (before taking: output pushed while a chunk is written wakes the next pass)
            for h, r in list(running.items()):
                done = h.finished  # (before taking: what comes while the chunk is written is taken next pass)
                text, _, lps = h.take()
                if h.prompt_scores is not None and h.prompt_logprobs is None and h.error is None:
                    for e in await bridge.off_loop(client, _prompt_events, bridge, h, r, include_usage, continuous):
                        yield e
                if text or lps:
                    for e in ev(r, h, r.stream_delta(text, lps, include_usage)):
                        yield e
                if not done:
                    continue
                del running[h]
                if (e := _failure(h, body)) is not None:
                    for failed in r.stream_failed(h, e):
                        yield failed
                    return
                for e in ev(r, h, r.stream_end(h, include_usage)):
                    yield e
            if running:
                await event.wait()
    finally:
        for h in running:  # (a choice failed, or the stream stopped)
            bridge.abort(h)
    if include_usage:
        yield renders[0].event(renders[0].usage_chunk(handles, n))
    if renders[0].DONE:
        yield renders[0].DONE


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
