"""Wire types of the WebSocket protocol (docs/protocol.md, version 1) as tagged msgspec Structs.

Client frames are decoded by one module-level Decoder; `decode_client` never raises: a bad frame
(nested too deep included: json_guard checks before any decode) becomes an `Error` to send back.
Unknown fields are rejected so typos do not pass silently.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Raw, Struct

from engine import InvalidSamplingParam, StructuredOutput
from service import json_guard

PROTOCOL_VERSION = 1

ErrorCode = Literal[
    "invalid_json", "invalid_message", "duplicate_id", "unknown_id", "prompt_too_long",
    "too_many_inflight", "overloaded", "unauthorized", "internal",
]
FinishReason = Literal["stop", "length", "cancelled"]

ChatId = Annotated[str, Meta(min_length=1, max_length=64)]
StopString = Annotated[str, Meta(min_length=1, max_length=256)]

# The sampling fields' wire ranges (docs/protocol.md §3), written once for both APIs: the WebSocket `chat` and
# OpenAI's requests (openai_api.py). They are what the API promises; SamplingParams checks what the engine can do.
MaxTokens = Annotated[int, Meta(ge=1)]
MinTokens = Annotated[int, Meta(ge=0)]  # (at most max_tokens: SamplingParams checks the two together)
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=2**31 - 1)]  # -1 or 0: off (vLLM takes both)
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # presence and frequency
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
StopStrings = Annotated[list[StopString], Meta(max_length=16)]
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "ignore_eos", "min_tokens")


_STRUCTURED = ("json", "regex", "choice", "json_object", "grammar", "structural_tag")


def structured_output(**given: Any) -> StructuredOutput | None:
    """What a request's structured-output fields ask for (engine/structured.py), from whichever one is set:
    OpenAI's `response_format` (`{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}`,
    or `{"type": "structural_tag", ...}`), vLLM's `guided_json` (a schema, or its JSON text), `guided_regex`,
    `guided_choice` (strings), `guided_grammar` (EBNF or Lark), `structural_tag` (its JSON text) or
    `structured_outputs` (`{"json" | "regex" | "choice" | "json_object" | "grammar" | "structural_tag": ...}`).
    Raises `InvalidSamplingParam` naming the field at fault; more than one set is refused."""
    given = {k: v for k, v in given.items() if v is not None and not (k == "response_format" and v == {"type": "text"})}
    if not given:
        return None
    if len(given) > 1:
        name = sorted(given)[1]
        raise InvalidSamplingParam(name, f"{name}: only one of {', '.join(sorted(given))} may be given")
    (name, value), = given.items()
    if name == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in _STRUCTURED:
            raise InvalidSamplingParam(name, f"{name} must hold one of {', '.join(_STRUCTURED)}")
        (key, value), = value.items()
        name, kind = f"{name}.{key}", key
    elif name == "response_format":
        if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema",
                                                                    "structural_tag"):
            raise InvalidSamplingParam(name, f'{name}.type must be "text", "json_object", "json_schema" or '
                                             '"structural_tag"')
        if value["type"] == "text":
            return None
        kind = {"json_object": "json_object", "json_schema": "json"}.get(value["type"], "structural_tag")
        if kind == "json":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise InvalidSamplingParam(name, f"{name}.json_schema must be an object whose schema is an object")
            value = spec.get("schema")
            kind = "json" if value is not None else "json_object"
    else:
        kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
                "structural_tag": "structural_tag"}[name]
    if kind == "json_object":
        if value not in (True, None) and name.startswith("structured_outputs"):
            raise InvalidSamplingParam(name, f"{name} must be true")
        return StructuredOutput("json_object", param=name)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json_guard.loads(value)
            except json_guard.TooDeep as e:
                raise InvalidSamplingParam(name, f"{name}: {e}") from None
            except ValueError:
                raise InvalidSamplingParam(name, f"{name}: a JSON schema, as an object or its JSON text") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidSamplingParam(name, f"{name}: a JSON schema, as an object or its JSON text")
        return StructuredOutput("json", json.dumps(value), name)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidSamplingParam(name, f"{name} must be a non-empty regular expression")
        return StructuredOutput("regex", value, name)
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise InvalidSamplingParam(name, f"{name} must be a grammar: EBNF (root ::= ...) or Lark (start: ...)")
        return StructuredOutput("grammar", value, name)
    if kind == "structural_tag":
        return StructuredOutput("structural_tag", json.dumps(_structural_tag(name, value)), name)
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise InvalidSamplingParam(name, f"{name} must be a non-empty list of non-empty strings")
    return StructuredOutput.choice(value, name)


def _structural_tag(name: str, value: Any) -> dict[str, Any]:
    """xgrammar's structural tag (`{"type": "structural_tag", "format": {...}}`) from its own form or vLLM's older
    one (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: text in which each part that begins with a
    trigger is one of the structures, its JSON of the schema between begin and end), as an object or its JSON text."""
    if isinstance(value, str):
        try:
            value = json_guard.loads(value)
        except json_guard.TooDeep as e:
            raise InvalidSamplingParam(name, f"{name}: {e}") from None
        except ValueError:
            value = None
    if isinstance(value, dict) and "format" in value:
        return {**value, "type": "structural_tag"}
    structures, triggers = (value.get("structures"), value.get("triggers")) if isinstance(value, dict) else (0, 0)
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)
            and all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                    and isinstance(s.get("schema", {}), (dict, bool)) for s in structures)):
        raise InvalidSamplingParam(name, f'{name} must be a structural tag: {{"format": {{...}}}}, or {{"structures": '
                                         f'[{{"begin", "schema", "end"}}], "triggers": [...]}}')
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": [
        {"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s.get("schema", {})},
         "end": s["end"]} for s in structures]}}


class _In(Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    pass


class ChatMessage(Struct, forbid_unknown_fields=True, frozen=True):
    role: Literal["system", "user", "assistant"]
    content: str


class Hello(_In, tag="hello"):
    api_key: str


class Chat(_In, tag="chat"):
    id: ChatId
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: StopStrings | None = None
    ignore_eos: bool | None = None
    min_tokens: MinTokens | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's (`structured_output`)

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields the client set (`SamplingParams` keyword arguments), max_tokens excluded. Raises
        `InvalidSamplingParam` for a `response_format` it cannot take."""
        kwargs = {n: getattr(self, n) for n in SAMPLING_FIELDS if getattr(self, n) is not None}
        if (so := structured_output(response_format=self.response_format)) is not None:
            kwargs["structured_output"] = so
        return kwargs

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


class Cancel(_In, tag="cancel"):
    id: ChatId


class Ping(_In, tag="ping"):
    data: Raw = Raw(b"null")  # echoed byte for byte, never parsed


class StatsRequest(_In, tag="stats"):
    pass


ClientMessage = Hello | Chat | Cancel | Ping | StatsRequest


class _Out(Struct, tag_field="type", frozen=True):
    pass


class Ready(_Out, tag="ready"):
    model: str
    max_model_len: int
    max_inflight: int
    protocol: int = PROTOCOL_VERSION
    # the model's sampling defaults (its generation config's: `temperature`, `top_p`, `top_k`, `min_p`,
    # `repetition_penalty`, `max_tokens` where it sets them): what a chat that leaves them out gets
    defaults: dict[str, float] = msgspec.field(default_factory=dict)


class Start(_Out, tag="start"):
    id: str
    prompt_tokens: int
    cached_tokens: int


class Delta(_Out, tag="delta", omit_defaults=True):
    id: str
    text: str
    tokens: int
    reasoning: str = ""  # `--reasoning-parser`: the reasoning's text (sent only when there is some)


class Usage(Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Timing(Struct, frozen=True):
    queue_ms: float
    ttft_ms: float | None  # None when the chat ended before its first token
    total_ms: float


class Done(_Out, tag="done"):
    id: str
    finish_reason: FinishReason
    usage: Usage
    timing: Timing


class Error(_Out, tag="error"):
    code: ErrorCode
    message: str
    id: str | None = None


class Pong(_Out, tag="pong"):
    data: Raw


class Stats(_Out, tag="stats"):
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    prompt_tokens_computed: int
    generation_tokens: int
    generation_tokens_per_s: float
    connections: int
    requests_in_flight: int


ServerMessage = Ready | Start | Delta | Done | Error | Pong | Stats


class _ChatIdProbe(Struct):
    """What a refused frame says about itself. Every other field is skipped, not converted, so a value that
    refused the frame (`1e999`, out of a float's range) does not hide its id."""
    type: str | None = None
    id: ChatId | None = None


_decoder = msgspec.json.Decoder(ClientMessage)
_probe = msgspec.json.Decoder(_ChatIdProbe)
_encoder = msgspec.json.Encoder()


def decode_client(frame: str | bytes) -> ClientMessage | Error:
    """Parse one client frame. Malformed JSON, or nested deeper than json_guard.MAX_DEPTH -> `invalid_json`;
    valid JSON of the wrong shape (an unpaired surrogate in a string included) -> `invalid_message`."""
    if (too_deep := json_guard.depth_error(frame)) is not None:
        return Error(code="invalid_json", message=f"frame refused: {too_deep}")
    try:
        return _decoder.decode(frame)
    except msgspec.ValidationError as e:
        return Error(code="invalid_message", message=f"frame does not match the protocol: {_short(str(e))}",
                     id=_chat_id_of(frame))
    except msgspec.DecodeError as e:
        if (surrogate := json_guard.surrogate_error(frame)) is not None:
            # the id, unless it holds a surrogate itself: then it reads differently with another stand-in for it
            one, other = (_chat_id_of(json_guard.without_unpaired_surrogates(frame, stand_in))
                          for stand_in in (b"\\ufffd", b"\\ufffe"))
            return Error(code="invalid_message", message=f"frame does not match the protocol: {_short(surrogate)}",
                         id=one if one == other else None)
        return Error(code="invalid_json", message=f"frame is not valid JSON: {_short(str(e))}")


ERROR_DETAIL_CHARS = 256


def _short(detail: str) -> str:
    """A decoder's message quotes what it refused (a field's name, a tag's value: a megabyte of it in a hostile
    frame); replies are queued for a client that may read nothing, so each is kept short."""
    if len(detail) <= ERROR_DETAIL_CHARS:
        return detail
    return f"{detail[:ERROR_DETAIL_CHARS]}... ({len(detail) - ERROR_DETAIL_CHARS} more characters)"


def _chat_id_of(frame: str | bytes) -> str | None:
    """The `id` of an invalid `chat` frame, when it has a well-formed one, so the client can match the error."""
    try:
        probe = _probe.decode(frame)
    except msgspec.DecodeError:  # the id itself is malformed, or the frame is not an object
        return None
    return probe.id if probe.type == "chat" else None


def encode(msg: ServerMessage) -> str:
    """One text frame. WebSocket text frames carry `str`, hence the decode of msgspec's UTF-8 bytes."""
    return _encoder.encode(msg).decode()


def encode_utf8(msg: ServerMessage) -> bytes:
    """`encode`'s frame as msgspec writes it, UTF-8: for a socket that takes a text frame's bytes as they are."""
    return _encoder.encode(msg)
