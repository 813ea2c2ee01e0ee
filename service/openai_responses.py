"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}.

A response is one chat turn. Its `instructions`, the conversation of its `previous_response_id` and its `input` items
(messages, the model's function calls and their outputs) make a chat request, checked and sampled as
/v1/chat/completions' are (`openai_api.chat_request`: tools, structured output, logprobs); the answer's text and tool
calls become its output items, and a stream sends the Responses API's typed events. `store` (OpenAI's default: true)
keeps the response in this server's memory (`ResponseStore`, bounded by --responses-store-mb, each client's share
max-min fair), so a later request continues it by id and GET / DELETE find it; a restart forgets them all.
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine import SamplingParams
from service import json_guard
from service.handle import RequestError, RequestHandle, TokenLogprobs, client_of
from service.openai_api import _error, _from_request_error, _generate, _read_body, chat_request
from service.openai_errors import HTTPError, error_response
from service.openai_render import ChatRender, Render
from service.response_store import TooLong
from service.openai_schema import (
    ChatCompletionRequest, CommonRequest, ResponseInputItem, ResponsesRequest, _Message, content_text,
)
from service.openai_tools import FunctionCall, FunctionDef, NamedToolChoice, Tool, ToolCall, _FunctionName

if TYPE_CHECKING:
    from service.state import Service

LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the answer's logprobs


# ---- a request as a chat --------------------------------------------------------------------------------------
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {  # (as openai_schema._UNSUPPORTED): neutral values, what to do
    "background": ((False,), "no background mode: ask without it"),
    "prompt": ((), "no stored prompt templates: give the input"),
    "conversation": ((), "no Conversations API: continue with previous_response_id"),
    "truncation": (("disabled",), "a conversation longer than the context is refused, never cut"),
    "max_tool_calls": ((), "no built-in tools"),
    "max_tokens": ((), "the Responses API's name is max_output_tokens"),
    "response_format": ((), "the Responses API's name is text.format"),
    "prompt_logprobs": ((), "not in the Responses API"),
}


def _reasoning_effort(body: ResponsesRequest, reasons: bool) -> str | None:
    """`reasoning.effort`, for the chat template's `reasoning_effort` (as chat's `reasoning_effort`): refused without
    `--reasoning-parser` (the model does not reason) unless none. `summary` is accepted and has no effect (the
    reasoning is given whole)."""
    r = body.reasoning
    if r is None:
        return None
    if not isinstance(r, dict) or not set(r) <= {"effort", "summary", "generate_summary"}:
        raise HTTPError(400, "reasoning must be an object with `effort` and `summary`", param="reasoning")
    for key in ("summary", "generate_summary"):
        if not isinstance(r.get(key), (str, type(None))):
            raise HTTPError(400, f"reasoning.{key} must be a string (auto, concise, detailed)", param=f"reasoning.{key}")
    effort = r.get("effort")
    if effort is not None and not (isinstance(effort, str) and 0 < len(effort) <= 32):
        raise HTTPError(400, "reasoning.effort must be a string (low, medium, high, ...)", param="reasoning.effort")
    if effort in (None, "none"):
        return None if not reasons else effort
    if not reasons:
        raise HTTPError(400, "`reasoning.effort` is not supported by this server (its model does not reason: no "
                             "--reasoning-parser); leave it out", param="reasoning.effort",
                        code="unsupported_parameter")
    return effort


def _refuse(body: ResponsesRequest) -> None:
    for name, (neutral, missing) in _REFUSED.items():
        value = getattr(body, name)
        if value is not None and value not in neutral:
            raise HTTPError(400, f"`{name}` is not supported by this server ({missing}); leave it out", param=name,
                            code="unsupported_parameter")
    if body.n not in (None, 1):
        raise HTTPError(400, "a response has one answer: n is not in the Responses API", param="n",
                        code="unsupported_parameter")


def _messages(items: str | list[ResponseInputItem]) -> list[_Message]:
    """`input` as chat messages: a function call joins the assistant message before it (one turn: its text and its
    calls), and its output is a tool message."""
    if isinstance(items, str):
        return [_Message("user", items)]
    out: list[_Message] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if item.type == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise HTTPError(400, f"{at}.role must be user, system, developer or assistant, got {item.role!r}",
                                param=f"{at}.role")
            if item.content is None:
                raise HTTPError(400, f"{at}: a message needs its content", param=f"{at}.content")
            out.append(_Message(item.role, content_text(item.content, f"{at}.content")))
        elif item.type == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise HTTPError(400, f"{at}: a function_call needs its call_id, name and arguments", param=at)
            if _stored_arguments(item.arguments) != item.arguments:
                raise HTTPError(400, f"{at}.arguments must be a JSON object's text", param=f"{at}.arguments")
            call = ToolCall(item.call_id, FunctionCall(item.name, item.arguments))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or ()), call]
            else:
                out.append(_Message("assistant", None, tool_calls=[call]))
        elif item.type == "reasoning":
            continue  # (an earlier answer's reasoning, given back: chat templates leave earlier reasoning out)
        elif item.type == "function_call_output":
            if not item.call_id or item.output is None:
                raise HTTPError(400, f"{at}: a function_call_output needs the call_id of its call and its output",
                                param=f"{at}.call_id" if not item.call_id else f"{at}.output")
            out.append(_Message("tool", content_text(item.output, f"{at}.output"), tool_call_id=item.call_id))
        else:
            raise HTTPError(400, f"{at}.type {item.type!r} is not supported: give messages, function_call and "
                                 "function_call_output items", param=f"{at}.type", code="unsupported_parameter")
    return out


def _tools(body: ResponsesRequest) -> tuple[list[Tool] | None, str | NamedToolChoice | None]:
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            if t.type != "function":
                raise HTTPError(400, f"tools[{i}].type {t.type!r}: only function tools are supported (no built-in "
                                     "tools)", param=f"tools[{i}].type", code="unsupported_parameter")
            if t.name is None:
                raise HTTPError(400, f"tools[{i}] needs a name", param=f"tools[{i}].name")
            tools.append(Tool("function", FunctionDef(t.name, t.description, t.parameters, t.strict)))
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return tools, choice
    if choice.type != "function" or choice.name is None:
        raise HTTPError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                        param="tool_choice")
    return tools, NamedToolChoice("function", _FunctionName(choice.name))


def _format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    f = body.text.format if body.text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.type == "json_schema":
        schema = {k: v for k, v in (("name", f.name), ("schema", f.schema), ("description", f.description),
                                    ("strict", f.strict)) if v is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise HTTPError(400, f"text.format.type must be text, json_object or json_schema, got {f.type!r}",
                    param="text.format.type")


def as_chat(body: ResponsesRequest, history: list[_Message],
            reasons: bool = False) -> tuple[ChatCompletionRequest, list[_Message]]:
    """The chat request a response is, and its turn's input messages (what the store keeps of them); `reasons`: the
    server has a `--reasoning-parser`."""
    _refuse(body)
    effort = _reasoning_effort(body, reasons)
    turn = _messages(body.input)
    if not turn:
        raise HTTPError(400, "input must hold at least one item", param="input")
    instructions = [_Message("system", body.instructions)] if body.instructions else []
    tools, tool_choice = _tools(body)
    logprobs = LOGPROBS in (body.include or ()) or body.top_logprobs is not None
    common = {name: getattr(body, name) for name in CommonRequest.__struct_fields__}
    common.update(max_tokens=None, response_format=_format(body), stream_options=None, n=None)
    chat = ChatCompletionRequest(**common, messages=[*instructions, *history, *turn],
                                 max_completion_tokens=body.max_output_tokens, logprobs=logprobs,
                                 top_logprobs=(body.top_logprobs or 0) if logprobs else None, tools=tools,
                                 tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                                 reasoning_effort=effort)
    return chat, turn


# ---- rendering ---------------------------------------------------------------------------------------------------
def _usage(h: RequestHandle) -> dict[str, Any]:
    prompt, completion = h.prompt_tokens or 0, h.completion_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": h.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": h.reasoning_tokens or 0},
            "total_tokens": prompt + completion}


def _message_item(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [_part(text, logprobs)]}


def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRender:
    """A response's body and its stream's events, over the chat renderer of its answer (its text, tool calls and
    logprobs as /v1/chat/completions streams them). Whole or streamed, the output items are made the same way, from
    those streamed deltas, in the order the answer makes them. Implements openai_render.Render; `done` is called with
    the final response object and the answer's message (the store's)."""

    DONE = b""  # (no `[DONE]`: the last event is the response's own)

    def __init__(self, chat: ChatRender, body: ResponsesRequest, model: str, done: Any,
                 params: SamplingParams) -> None:
        self.chat = chat
        self.body = body
        self.params = params  # (the response shows the temperature and top_p it ran with: the model's defaults too)
        self.model = model
        self.done = done
        self.logprobs = chat.logprobs
        # with tools the model may call, text that is only whitespace (around calls) makes no message of its own
        self.hold_space = chat.tools is not None and chat.tools.mode == "auto"
        self.id = _item_id("resp")
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the finished output items
        self.open: dict[str, Any] | None = None  # the item being made: a message or a function call
        self.calls: dict[int, dict[str, Any]] = {}  # the function calls by the chat renderer's index
        self.space: tuple[str, list[dict[str, Any]]] = ("", [])  # whitespace held back (`hold_space`), its logprobs

    def siblings(self, n: int) -> list[Render]:
        return [self]  # type: ignore[list-item]

    # -- the response object
    def _object(self, status: str, output: list[dict[str, Any]], h: RequestHandle | None,
                error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        text = b.text.format if b.text is not None and b.text.format is not None else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "background": False,
                "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "reasoning": self._reasoning_param(),
                "store": b.store is not False, "temperature": self.params.temperature,
                "text": {"format": msgspec.to_builtins(text) if text is not None else {"type": "text"}},
                "tool_choice": msgspec.to_builtins(b.tool_choice) if b.tool_choice is not None else "auto",
                "tools": msgspec.to_builtins(b.tools or []), "top_logprobs": b.top_logprobs or 0,
                "top_p": self.params.top_p, "truncation": "disabled",
                "usage": _usage(h) if h is not None else None, "user": b.user, "metadata": b.metadata or {}}

    def _reasoning_param(self) -> dict[str, Any]:
        r = self.body.reasoning if isinstance(self.body.reasoning, dict) else {}
        return {"effort": r.get("effort"), "summary": r.get("summary")}

    def _end(self, h: RequestHandle) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The answer's last events (its open item closed) and the final response object, handed to `done`."""
        chunks = self.chat.stream_end(h, False)
        events = self._from_chat(chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
        if not self.items and self.open is None:  # (an empty answer is an empty message)
            events += self._open_message()
        events += self._close("incomplete" if reason == "length" else "completed")
        body = self._object("incomplete" if reason == "length" else "completed", self.items, h)
        content = "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])
        calls = [ToolCall(i["call_id"], FunctionCall(i["name"], _stored_arguments(i["arguments"])))
                 for i in self.items if i["type"] == "function_call"]
        self.done(body, _Message("assistant", content if content or not calls else None, tool_calls=calls or None))
        return events, body

    def response(self, renders: list[Render], handles: list[RequestHandle], n: int) -> dict[str, Any]:
        h = handles[0]
        text, _, lps = h.take()
        if text or lps:
            self._from_chat(self.chat.stream_delta(text, lps, False))
        return self._end(h)[1]

    # -- the stream
    def event(self, chunk: dict[str, Any]) -> bytes:
        return b"event: " + chunk["type"].encode() + b"\ndata: " + msgspec.json.encode(chunk) + b"\n\n"

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def stream_start(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        response = self._object("in_progress", [], None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def stream_prompt(self, include_usage: bool) -> list[dict[str, Any]]:
        return []

    def stream_delta(self, text: str, lps: list[TokenLogprobs], include_usage: bool) -> list[dict[str, Any]]:
        return self._from_chat(self.chat.stream_delta(text, lps, False))

    def stream_end(self, h: RequestHandle, include_usage: bool) -> list[dict[str, Any]]:
        events, body = self._end(h)
        return events + [self._event(f"response.{body['status']}", response=body)]

    def watch(self, h: RequestHandle) -> None:
        self.chat.watch(h)

    def stream_failed(self, h: RequestHandle, e: HTTPError) -> list[bytes]:
        """The open item closed as incomplete, then `response.failed` with the error (a code of the Responses API's:
        `rate_limit_exceeded` for an overloaded server, else `server_error`)."""
        events = self._close("incomplete")
        error = {"code": "rate_limit_exceeded" if e.status == 429 else "server_error", "message": e.message}
        events.append(self._event("response.failed", response=self._object("failed", self.items, h, error)))
        return [self.event(event) for event in events]

    def usage_chunk(self, handles: list[RequestHandle], n: int) -> dict[str, Any]:
        raise AssertionError("a response's usage is in its last event")  # (no stream_options.include_usage)

    def _from_chat(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat renderer's chunks as the Responses API's events: text into the open message, each tool call an
        item of its own (one item is open at a time)."""
        events: list[dict[str, Any]] = []
        for chunk in chunks:
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if "reasoning_content" in delta:
                events += self._reasoning(delta["reasoning_content"])
            if "content" in delta:
                events += self._text(delta["content"], choice["logprobs"]["content"] if choice["logprobs"] else [])
            for call in delta.get("tool_calls", ()):
                if "id" in call:  # a new call
                    events += self._close("completed")
                    self.space = ("", [])  # (whitespace between a message and a call, or two calls, makes nothing)
                    self.open = self.calls[call["index"]] = {"type": "function_call", "id": _item_id("fc"),
                                                             "call_id": call["id"], "name": call["function"]["name"],
                                                             "arguments": ""}
                    item = _call_item(self.open["id"], call["id"], self.open["name"], "", "in_progress")
                    events.append(self._event("response.output_item.added", output_index=len(self.items), item=item))
                args = call["function"].get("arguments") or ""
                if args:
                    self.calls[call["index"]]["arguments"] += args
                    events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                              output_index=len(self.items), delta=args))
        return events

    def _text(self, text: str, lps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "message":
            if self.hold_space:
                held, held_lps = self.space
                if not (held + text).strip():
                    self.space = (held + text, held_lps + lps)
                    return []
                text, lps, self.space = held + text, held_lps + lps, ("", [])
            events += self._close("completed") + self._open_message()
        o = self.open
        assert o is not None
        o["text"] += text
        o["logprobs"] += lps
        events.append(self._event("response.output_text.delta", item_id=o["id"], output_index=len(self.items),
                                  content_index=0, delta=text, logprobs=lps))
        return events

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """`--reasoning-parser`: the answer's reasoning as a `reasoning` item (its text as `reasoning_text`)."""
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close("completed")
            self.open = {"type": "reasoning", "id": _item_id("rs"), "text": ""}
            events.append(self._event("response.output_item.added", output_index=len(self.items),
                                      item=_reasoning_item(self.open["id"], None, "in_progress")))
        self.open["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items), content_index=0, delta=text))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self.open = {"type": "message", "id": _item_id("msg"), "text": "", "logprobs": []}
        at = len(self.items)
        return [self._event("response.output_item.added", output_index=at,
                            item=_message_item(self.open["id"], "", [], "in_progress")),
                self._event("response.content_part.added", item_id=self.open["id"], output_index=at, content_index=0,
                            part=_part("", []))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's closing events; it joins the output."""
        o, self.open, at = self.open, None, len(self.items)
        if o is None:
            return []
        if o["type"] == "message":
            item = _message_item(o["id"], o["text"], o["logprobs"], status)
            events = [self._event("response.output_text.done", item_id=o["id"], output_index=at, content_index=0,
                                  text=o["text"], logprobs=o["logprobs"]),
                      self._event("response.content_part.done", item_id=o["id"], output_index=at, content_index=0,
                                  part=item["content"][0])]
        elif o["type"] == "reasoning":
            item = _reasoning_item(o["id"], o["text"], status)
            events = [self._event("response.reasoning_text.done", item_id=o["id"], output_index=at, content_index=0,
                                  text=o["text"])]
        else:
            item = _call_item(o["id"], o["call_id"], o["name"], o["arguments"], status)
            events = [self._event("response.function_call_arguments.done", item_id=o["id"], output_index=at,
                                  name=o["name"], arguments=o["arguments"])]
        self.items.append(item)
        return events + [self._event("response.output_item.done", output_index=at, item=item)]


def _stored_arguments(arguments: str) -> str:
    """A call's arguments as its conversation keeps them: a call cut off (`max_output_tokens`), or one the model wrote
    that is not a JSON object, is kept with `{}`, which a chat template can show (its text stays in the output)."""
    try:
        return arguments if isinstance(json_guard.loads(arguments), dict) else "{}"
    except ValueError:
        return "{}"


# ---- routes ----------------------------------------------------------------------------------------------------
async def create_response(request: Request) -> Response:
    svc: Service = request.app.state.service
    try:
        body = await _read_body(request, ResponsesRequest, svc.config.max_message_bytes)
        if not svc.accepting:  # (before the store is read: the context's length is not known yet)
            raise HTTPError(503, "the server is starting or shutting down; retry shortly")
        history: list[_Message] = []
        if body.previous_response_id is not None:
            try:  # (every message takes a token at least: more than the context's tokens cannot fit)
                found = svc.responses.conversation(body.previous_response_id, svc.bridge.max_model_len)
            except TooLong as e:
                raise HTTPError(400, f"{e}: more than the context ({svc.bridge.max_model_len} tokens) holds",
                                param="previous_response_id", code="context_length_exceeded") from None
            if found is None:
                message = (f"Previous response with id '{body.previous_response_id}' not found."
                           if svc.responses.get(body.previous_response_id) is None else
                           f"An earlier turn of the conversation of previous response '{body.previous_response_id}' "
                           "is gone (deleted, or evicted from the store); it can no longer be continued.")
                raise HTTPError(400, message, param="previous_response_id", code="previous_response_not_found")
            history = found
        chat, turn = as_chat(body, history, svc.config.reasoning_parser is not None)
        client = client_of(request)
        req, chat_render = chat_request(svc, chat, client, api="responses")
        store, loop = body.store is not False, asyncio.get_running_loop()

        def done(response: dict[str, Any], answer: _Message) -> None:
            """On the loop or the tokenizer thread (a response with logprobs is made there): the store is the
            loop's, and keeps the response encoded."""
            if store:
                loop.call_soon_threadsafe(svc.responses.put, response["id"], msgspec.json.encode(response),
                                          [*turn, answer], body.previous_response_id, client)

        render = ResponsesRender(chat_render, body, svc.model_name, done, req.params)
        return await _generate(request, svc, [req], render, body)  # type: ignore[arg-type]
    except RequestError as e:
        return _error(_renamed(_from_request_error(e, "input")))
    except HTTPError as e:
        return _error(_renamed(e))


_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}


def _renamed(e: HTTPError) -> HTTPError:
    """An error of the chat path, naming the Responses API's field: `messages[i]...` (its instructions, the stored
    conversation and the input together) is `input`."""
    if e.param is not None and e.code != "unsupported_parameter":  # (`_refuse` names what the client sent)
        if (name := _PARAMS.get(e.param)) is not None:  # (the message names the field too)
            e.message = re.sub(rf"\b{re.escape(e.param)}\b", name, e.message)
        e.param = "input" if e.param.startswith("messages") else _PARAMS.get(e.param, e.param)
    return e


def _stored(request: Request) -> tuple[Service, str]:
    return request.app.state.service, request.path_params["response_id"]


def _not_found(response_id: str) -> Response:
    return error_response(404, f"Response with id '{response_id}' not found.", param="response_id",
                          code="response_not_found")


async def get_response(request: Request) -> Response:
    svc, response_id = _stored(request)
    stored = svc.responses.get(response_id)
    if stored is None:
        return _not_found(response_id)
    return Response(stored.body, media_type="application/json")


async def list_input_items(request: Request) -> Response:
    """GET /v1/responses/{id}/input_items: the items of a stored response's `input`, as the store keeps them
    (messages, function calls and their outputs; reasoning items given back are not kept), a page at a time:
    `limit` (1-100, default 20), `order` (`desc`, the default: the last first; or `asc`), `after` an item's id."""
    svc, response_id = _stored(request)
    stored = svc.responses.get(response_id)
    if stored is None:
        return _not_found(response_id)
    query = request.query_params
    limit = query.get("limit", "20")
    if not (limit.isdecimal() and 1 <= int(limit) <= 100):
        return error_response(400, f"limit must be an integer from 1 to 100, got {limit!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        return error_response(400, f"order must be asc or desc, got {order!r}", param="order")
    if query.getlist("include"):
        return error_response(400, "include is not supported for input items (they carry no logprobs or outputs)",
                              param="include", code="unsupported_parameter")
    items = _input_items(response_id, stored.turn[:-1])  # (the turn's last message is the answer)
    if order == "desc":
        items.reverse()
    start = 0
    if (after := query.get("after")) is not None:
        start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), -1)
        if start < 0:
            return error_response(400, f"after: no input item {after!r} in response '{response_id}'", param="after")
    page = items[start:start + int(limit)]
    return Response(msgspec.json.encode({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(items)}),
        media_type="application/json")


def _input_items(response_id: str, messages: list[_Message]) -> list[dict[str, Any]]:
    """A turn's input messages as Responses API items, with ids made from the response's (the same at every call)."""
    base, out = response_id.removeprefix("resp_"), []

    def add(prefix: str, item: dict[str, Any]) -> None:
        out.append({"id": f"{prefix}_{base}{len(out):04d}", **item, "status": "completed"})

    for m in messages:
        if m.role == "tool":
            add("fco", {"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content or ""})
            continue
        if m.content is not None or not m.tool_calls:
            part = ({"type": "output_text", "text": m.content or "", "annotations": []} if m.role == "assistant" else
                    {"type": "input_text", "text": m.content or ""})
            add("msg", {"type": "message", "role": m.role, "content": [part]})
        for call in m.tool_calls or ():
            add("fc", {"type": "function_call", "call_id": call.id, "name": call.function.name,
                       "arguments": call.function.arguments})
    return out


async def delete_response(request: Request) -> Response:
    svc, response_id = _stored(request)
    if not svc.responses.delete(response_id):
        return _not_found(response_id)
    return Response(msgspec.json.encode({"id": response_id, "object": "response", "deleted": True}),
                    media_type="application/json")

