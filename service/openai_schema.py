"""OpenAI's request bodies: msgspec schemas (unknown fields are ignored: OpenAI clients send many), their decoding
with OpenAI's `param` named on errors, the parameters refused because they would change the output, and the
prompt a body asks for."""
from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from engine import InvalidSamplingParam
from service import json_guard
from service.openai_errors import HTTPError
from service.openai_tools import NamedToolChoice, Tool, ToolCall, template_messages
from service.protocol import (
    SAMPLING_FIELDS, MaxTokens, MinP, MinTokens, Penalty, RepetitionPenalty, Seed, StopString, StopStrings, Temperature,
    TopK, TopP, structured_output,
)


class _ContentPart(Struct):
    """A part of a message's content (chat's and the Responses API's): only text is taken (`TEXT_PARTS`)."""
    type: str
    text: str | None = None
    refusal: str | None = None  # (a `refusal` part's text: an assistant's earlier refusal, replayed)


TEXT_PARTS = ("text", "input_text", "output_text", "refusal")  # (vLLM's text parts)


def content_text(content: str | list[_ContentPart] | None, at: str) -> str:
    """A message's content as its template takes it: a string, or its text parts joined by newlines (as vLLM joins
    them); another part is a 400 naming it (`at`: the content's path)."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise HTTPError(400, f"{at}[{j}].type {part.type!r}: only text parts are supported",
                            param=f"{at}[{j}].type", code="unsupported_parameter")
    return "\n".join((part.refusal if part.type == "refusal" else part.text) or "" for part in content)


class _Message(Struct):
    role: str
    content: str | list[_ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (service/openai_tools.py)
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None


class _StreamOptions(Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's) with include_usage: every chunk has its choice's usage so far


class _ResponsesStreamOptions(Struct):
    include_obfuscation: bool = True  # (the Responses API's; no obfuscation is sent either way)


TokenId = Annotated[int, Meta(ge=0)]
MAX_N = 128  # choices a request may ask for (`n`), as OpenAI's bound
MAX_CHOICES = 1024  # choices of a completion request over its batch of prompts


class CommonRequest(Struct):
    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None  # choices (null: the default, 1)
    stream: bool | None = None
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
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=1024)] | None = None
    include_stop_str_in_output: bool | None = None
    min_tokens: MinTokens | None = None
    # the tokenizer's own special tokens (a BOS): added to a completion's text prompt, not to a chat's (its template
    # writes them); vLLM's defaults
    add_special_tokens: bool | None = None
    # token ids (as strings: JSON's keys) -> a bias added to the token's logit
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=1024)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None  # (vLLM's)
    bad_words: Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=256)] | None = None
    # structured output (service/protocol.py `structured_output`): OpenAI's, and vLLM's extensions
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    # not implemented, and each would change the output: refused by `refuse_unsupported`, never ignored
    use_beam_search: Any = None
    length_penalty: Any = None
    skip_special_tokens: Any = None
    # vLLM's: only the prompt's last k tokens (its templated tokens, for a chat); -1: as many as the context holds
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    # (vLLM's) each prompt token's logprob with this many top alternatives: completions' choices' and chat's response's
    # `prompt_logprobs` (the first token's None); not with streaming
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None  # (vLLM's) logprobs name tokens `token_id:N`

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling fields the client set (`SamplingParams` keyword arguments), max_tokens excluded."""
        kwargs = {n: getattr(self, n) for n in SAMPLING_FIELDS if getattr(self, n) is not None}
        if isinstance(self.stop, str):
            kwargs["stop"] = [self.stop]
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = self.stop_token_ids
        if self.include_stop_str_in_output:
            kwargs["include_stop_str_in_output"] = True
        if self.allowed_token_ids is not None:
            kwargs["allowed_token_ids"] = self.allowed_token_ids
        if self.bad_words:
            kwargs["bad_words"] = self.bad_words
        if self.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = self.prompt_logprobs
        if self.logit_bias:
            if not all(re.fullmatch(r"0|[1-9][0-9]{0,9}", k) for k in self.logit_bias):  # ("05" would be "5" twice)
                raise HTTPError(400, "logit_bias: each key must be a token id (a decimal integer, no leading zeros)",
                                param="logit_bias", code="invalid_message")
            kwargs["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        try:
            so = structured_output(response_format=self.response_format, guided_json=self.guided_json,
                                   guided_regex=self.guided_regex, guided_choice=self.guided_choice,
                                   guided_grammar=self.guided_grammar, structural_tag=self.structural_tag,
                                   structured_outputs=self.structured_outputs)
        except InvalidSamplingParam as e:
            raise HTTPError(400, str(e), param=e.param, code="invalid_message") from None
        if so is not None:
            kwargs["structured_output"] = so
        return kwargs


class ChatCompletionRequest(CommonRequest):
    messages: Annotated[list[_Message], Meta(min_length=1)] = []
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None  # tool calling: service/openai_tools.py
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None  # (OpenAI's older form of tools: refused, see CommonRequest)
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    # vLLM's chat extensions: the answer starts with the last message's text if that is the assistant's (`echo`); the
    # template's generation prompt, or instead the last message left open for the answer to continue
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: Any = None  # (refused: a client's template would run on the server's tokenizer thread)
    # OpenAI's, for a reasoning model: given to the chat template as `reasoning_effort` (templates that read it use it)
    reasoning_effort: Annotated[str, Meta(max_length=32)] | None = None
    # (vLLM's) more variables for the model's chat template (Qwen3's `enable_thinking`, say); documents for a RAG one
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[Any] = ""
    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # (0: vLLM's prompt alone, with `echo`)
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ResponseInputItem(Struct):
    """One item of a Responses API `input`: a message (`type` "message", the default), a `function_call` the model made
    or a `function_call_output` (its result)."""
    type: str = "message"
    role: str | None = None
    content: str | list[_ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_ContentPart] | None = None
    id: str | None = None
    status: str | None = None


class ResponseTool(Struct):
    type: str  # "function": the Responses API's flat form of a chat tool
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoice(Struct):
    type: str
    name: str | None = None


class ResponseTextFormat(Struct):
    type: str  # text, json_object or json_schema
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseText(Struct):
    format: ResponseTextFormat | None = None
    verbosity: Any = None


MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]


class ResponsesRequest(CommonRequest):
    """The Responses API's body (POST /v1/responses: service/openai_responses.py). Its sampling fields are the common
    ones (vLLM's extensions too); chat's own that have a Responses name are refused under chat's."""
    input: str | list[ResponseInputItem] = ""
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: str | ResponseToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    include: list[str] | None = None
    stream_options: _ResponsesStreamOptions | None = None
    truncation: str | None = None
    user: str | None = None
    # refused unless neutral (service/openai_responses.py): each would change the answer or what is kept
    background: Any = None
    reasoning: Any = None
    prompt: Any = None
    conversation: Any = None
    max_tool_calls: Any = None


class TokenizeRequest(Struct):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` templated as a chat completion's are."""
    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None
    add_special_tokens: bool | None = None  # (default: true for a prompt, false for messages, as vLLM's)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: Any = None  # (refused, as chat's)


class DetokenizeRequest(Struct):
    """vLLM's /detokenize."""
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: str | None = None


# parameter -> (the values that leave the output as Sluice makes it, besides null or leaving it out; what is missing)
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "give them as `tools`"),
    "function_call": (("none",), "give `tool_choice`, with `tools`"),
    "audio": ((), "text output only"),
    "modalities": ((["text"],), "text output only"),
    "use_beam_search": ((False,), "no beam search"),
    "length_penalty": ((1, 1.0), "no beam search"),
    "skip_special_tokens": ((True,), "special tokens are never in the text"),
    "logits_processors": (([],), "no custom logits processors"),
    "chat_template": ((), "the model's own chat template only"),
}


_COMPLETIONS_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((), "no text insertion"),
    "best_of": ((1,), "no best-of ranking: ask for n choices"),
}


def refuse_unsupported(body: CommonRequest) -> None:
    refused = {**_UNSUPPORTED, **_COMPLETIONS_UNSUPPORTED} if isinstance(body, CompletionRequest) else _UNSUPPORTED
    for name, (neutral, missing) in refused.items():
        value = getattr(body, name, None)
        if value is not None and value not in neutral:
            raise HTTPError(400, f"`{name}` is not supported by this server ({missing}); leave it out",
                            param=name, code="unsupported_parameter")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


# the chat template's own arguments: `chat_template_kwargs` may not set them
_TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                 "continue_final_message", "tokenize", "return_dict", "return_assistant_tokens_mask",
                                 "chat_template", "padding", "truncation", "max_length", "return_tensors",
                                 "tokenizer_kwargs", "bos_token", "eos_token", "raise_exception", "strftime_now"})


def template_kwargs(body: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any] | None:
    """`chat_template_kwargs` (and `reasoning_effort`), checked: each key a name the template can read, none of its
    own arguments."""
    kwargs = body.chat_template_kwargs
    effort = getattr(body, "reasoning_effort", None)  # (a chat completion's; not /tokenize's)
    if effort is not None:  # (chat_template_kwargs, if it names it too, wins: as vLLM's)
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    if not kwargs:
        return None
    for key in kwargs:
        if not key.isidentifier() or key in _TEMPLATE_ARGUMENTS:
            raise HTTPError(400, f"chat_template_kwargs: {key!r} is not a variable the template may be given (a name, "
                                 "not one of the template's own arguments)", param="chat_template_kwargs")
    return kwargs


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: role and content, an assistant's tool calls (their arguments a
    mapping), a tool message's call id."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise HTTPError(400, f"messages[{i}].role {m.role!r} is not supported; use system, user, assistant or "
                                 "tool", param=f"messages[{i}].role",
                            code="unsupported_parameter" if m.role == "function" else "invalid_message")
        if role == "tool" and not m.tool_call_id:
            raise HTTPError(400, f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                            param=f"messages[{i}].tool_call_id")
        if m.tool_calls and role != "assistant":
            raise HTTPError(400, f"messages[{i}]: only an assistant's message has tool_calls",
                            param=f"messages[{i}].tool_calls")
        content = content_text(m.content, f"messages[{i}].content")
        message: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
        if role == "tool":
            message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
        out.append(message)
    template_messages(out)
    return out


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a list of token ids, or a list of those (a batch: each prompt
    gets its `n` choices, OpenAI's and vLLM's choice `index` being prompt * n + choice)."""
    p = body.prompt
    batch = p if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else [p]
    for i, x in enumerate(batch):
        if not (isinstance(x, str) or (isinstance(x, list) and x and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x))):
            at = f"prompt[{i}]" if batch is p else "prompt"
            raise HTTPError(400, f"{at} must be a string or a non-empty list of token ids", param="prompt")
    if len(batch) * (body.n or 1) > MAX_CHOICES:
        raise HTTPError(400, f"{len(batch)} prompts x n={body.n or 1} asks for more than {MAX_CHOICES} choices; split "
                             "the batch", param="prompt")
    return batch


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
    """OpenAI's `param` from a msgspec error: `messages[0].role` for "... - at `$.messages[0].role`"; a map's value
    (msgspec's `[...]`) is its field's: `logit_bias`."""
    at, missing = _AT.search(message), _MISSING.search(message)
    return ".".join(m.group(1) for m in (at, missing) if m and m.group(1)).replace("[...]", "") or None
