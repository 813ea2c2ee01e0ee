"""OpenAI's request bodies: msgspec schemas (unknown fields are ignored: OpenAI clients send many), their decoding
with OpenAI's `param` named on errors, the parameters refused because they would change the output, and the
prompt a body asks for."""
from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from service import json_guard
from service.openai_errors import HTTPError
from service.protocol import (
    SAMPLING_FIELDS, MaxTokens, MinP, Penalty, RepetitionPenalty, Seed, StopString, StopStrings, Temperature, TopK, TopP,
)


class _ContentPart(Struct):
    type: str
    text: str | None = None


class _Message(Struct):
    role: str
    content: str | list[_ContentPart] | None = None


class _StreamOptions(Struct):
    include_usage: bool = False


class CommonRequest(Struct):
    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: StopString | StopStrings | None = None  # one string, or a list as on the WebSocket
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # extensions under vLLM's names, reachable through the openai client's `extra_body`
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    # not implemented, and each would change the output: refused by `_refuse_unsupported`, never ignored
    logit_bias: Any = None
    response_format: Any = None
    guided_json: Any = None  # vLLM's guided decoding
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields the client set (`SamplingParams` keyword arguments), max_tokens excluded."""
        kwargs = {n: getattr(self, n) for n in SAMPLING_FIELDS if getattr(self, n) is not None}
        if isinstance(self.stop, str):
            kwargs["stop"] = [self.stop]
        return kwargs


class ChatCompletionRequest(CommonRequest):
    messages: Annotated[list[_Message], Meta(min_length=1)] = []
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: Any = None  # not implemented, see CommonRequest
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None


class CompletionRequest(CommonRequest):
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


def refuse_unsupported(body: CommonRequest) -> None:
    for name, (neutral, missing) in _UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and value not in neutral:
            raise HTTPError(400, f"`{name}` is not supported by this server ({missing}); leave it out",
                            param=name, code="unsupported_parameter")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
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


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    p = body.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise HTTPError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")


def decode_body(data: bytes, struct: type[Struct]) -> Any:
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
