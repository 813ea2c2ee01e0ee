"""OpenAI's tool calling on chat completions, as vLLM serves it.

The tools go to the chat template (`tools`), which decides how the model sees them; earlier turns' tool calls
(an assistant's `tool_calls`) and results (`tool` messages) go to it too. What comes back depends on `tool_choice`:

- `{"type": "function", "function": {"name": N}}`: the answer is held to N's parameters (structured output, a JSON
  schema) and is returned as one call of N, its text the call's `arguments`;
- `required`: the answer is held to a JSON list of one or more `{"name", "parameters"}` objects, one of the tools
  each (one only with `parallel_tool_calls: false`), returned as calls;
- `auto` (the default when tools are given): the model decides; its text is parsed for calls by the server's
  `--tool-call-parser` (`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5's and Hermes'
  format; `llama3_json`: an answer that is `{"name": ..., "parameters": {...}}` objects, Llama 3.1-3.3's), which needs `--enable-auto-tool-choice`, as in vLLM; with `parallel_tool_calls: false` its first call
  only;
- `none`: plain text.

An answer with calls finishes with `tool_calls` (`stop` for a named one, as OpenAI's); one cut short by `max_tokens`
keeps `length`, and a `required` answer that is then not a whole list comes back as text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from msgspec import Struct

from engine import StructuredOutput
from service import json_guard
from service.openai_errors import HTTPError

MAX_TOOLS = 128  # OpenAI's bound
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


class FunctionDef(Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    type: str
    function: FunctionDef


class _FunctionName(Struct):
    name: str


class NamedToolChoice(Struct):
    type: str
    function: _FunctionName


class FunctionCall(Struct):
    name: str
    arguments: str


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


Mode = Literal["none", "named", "required", "auto"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of its answer: `mode`, the named function's name, the tools as the chat template
    takes them, the structured output that holds the answer (named, required) and the parser of `auto`."""

    mode: Mode
    name: str | None = None
    tools: list[dict[str, Any]] | None = None
    structured_output: StructuredOutput | None = None
    parser: str | None = None
    parallel: bool = True
    names: frozenset[str] = frozenset()  # the tools' names


def plan(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None, parallel_tool_calls: bool | None,
         parser: str | None) -> ToolPlan:
    """The request's `ToolPlan`; a 400 naming `tools` or `tool_choice` for one that cannot be served. `parser`: the
    server's `--tool-call-parser` if `--enable-auto-tool-choice`, else None."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise HTTPError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
        return ToolPlan("none")
    if len(tools) > MAX_TOOLS:
        raise HTTPError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    names: set[str] = set()
    for i, t in enumerate(tools):
        if t.type != "function":
            raise HTTPError(400, f"tools[{i}].type must be 'function', got {t.type!r}", param=f"tools[{i}].type")
        if not _NAME.fullmatch(t.function.name):
            raise HTTPError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got "
                                 f"{t.function.name!r}", param=f"tools[{i}].function.name")
        if t.function.name in names:
            raise HTTPError(400, f"tools[{i}].function.name {t.function.name!r} is given twice",
                            param=f"tools[{i}].function.name")
        names.add(t.function.name)
    listed = [{"type": "function", "function": {k: v for k, v in (
        ("name", t.function.name), ("description", t.function.description), ("parameters", t.function.parameters))
        if v is not None}} for t in tools]
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise HTTPError(400, f"tool_choice.type must be 'function', got {choice.type!r}", param="tool_choice")
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise HTTPError(400, f"tool_choice names {choice.function.name!r}, which is not one of the tools",
                            param="tool_choice")
        return ToolPlan("named", tool.function.name, listed, _held(_parameters(tool)), parallel=parallel)
    if choice == "required":
        # NOTE: each tool's definitions ($defs: pydantic's nested models and enums) move to the list's root, where
        # their references (#/$defs/...) point from inside it
        defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
        call = []
        for t in tools:
            params = dict(_parameters(t))
            for key, merged in defs.items():
                for name, d in (params.pop(key, None) or {}).items():
                    if merged.setdefault(name, d) != d:
                        raise HTTPError(400, f"tools define {key}.{name} differently; give their definitions distinct "
                                             "names", param="tools")
            call.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                          "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}, **({} if parallel else {"maxItems": 1}),
                  **{k: v for k, v in defs.items() if v}}
        return ToolPlan("required", None, listed, _held(schema), parallel=parallel)
    if choice == "auto":
        if parser is None:
            raise HTTPError(400, '"auto" tool choice (the default when tools are given) needs the server started with '
                                 "--enable-auto-tool-choice and --tool-call-parser; ask for \"required\", a named "
                                 "function or \"none\"", param="tool_choice")
        return ToolPlan("auto", None, listed, None, parser, parallel, frozenset(names))
    if choice == "none":
        return ToolPlan("none", None, listed)
    raise HTTPError(400, f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                    param="tool_choice")


def _parameters(tool: Tool) -> dict[str, Any]:
    """A function's parameters' schema: none given (or `{}`) is an object with any properties, as OpenAI takes it."""
    return tool.function.parameters or {"type": "object"}


def _held(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema), "tool_choice")


def template_messages(messages: list[Any]) -> None:
    """In place: an assistant message's `tool_calls` as chat templates take them (`arguments` a mapping, as
    transformers and vLLM give it); a 400 naming the call whose arguments are not a JSON object."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            if call["type"] != "function":
                raise HTTPError(400, f"messages[{i}].tool_calls[{j}].type must be 'function', got {call['type']!r}",
                                param=f"messages[{i}].tool_calls[{j}].type")
            args = _json(call["function"]["arguments"] or "{}")
            if not isinstance(args, dict):
                raise HTTPError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object's text",
                                param=f"messages[{i}].tool_calls[{j}].function.arguments")
            call["function"]["arguments"] = args


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _json(text: str) -> Any:
    """`text` as JSON; None if it is not, or nests deeper than a request body may (the body's guard does not look
    inside its strings, nor at what the model writes)."""
    try:
        return json_guard.loads(text)
    except ValueError:
        return None


def _calls_of_list(text: str) -> list[dict[str, Any]] | None:
    """`required`'s answer (a JSON list of {"name", "parameters"}) as calls; None if it is not one (cut short)."""
    items = _json(text)
    if not isinstance(items, list) or not all(isinstance(x, dict) and "name" in x for x in items):
        return None
    return [_call(x["name"], json.dumps(x.get("parameters", {}), ensure_ascii=False)) for x in items]


def _named_call(obj: Any) -> dict[str, Any] | None:
    """A call written as `{"name", "arguments"}` (or `"parameters"`), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return _call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _hermes_call(body: str) -> dict[str, Any] | None:
    return _named_call(_json(body))


_BETWEEN_CALLS = re.compile(r"[ \t\n\r;]*")


def _json_calls(text: str, names: frozenset[str]) -> list[dict[str, Any]] | None:
    """llama3_json's answer (Llama 3.1-3.3): one or more `{"name", "parameters"}` objects (or `"arguments"`), each
    naming one of the tools, `;` between them, and nothing else; None if it is not wholly that (an answer that is
    other JSON, say of a response_format)."""
    if json_guard.depth_error(text) is not None:
        return None
    decoder, at, calls = json.JSONDecoder(), 0, []
    while (at := _BETWEEN_CALLS.match(text, at).end()) < len(text):  # type: ignore[union-attr]
        try:
            obj, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        if not (isinstance(obj, dict) and obj.get("name") in names and ("parameters" in obj or "arguments" in obj)):
            return None
        calls.append(_named_call(obj))
    return calls or None


def answer(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's `content` and tool calls."""
    if p.mode == "named":  # (no text at all, a reasoning model's answer cut off in its reasoning: no call)
        return None, [_call(p.name, text)] if text else []  # type: ignore[arg-type]
    if p.mode == "required":
        calls = _calls_of_list(text)
        return (text or None, []) if calls is None else (None, calls)
    if p.mode == "auto":  # (as streamed: a block that is not a call stays in the text)
        stream = ToolStream(p)
        deltas = stream.feed(text) + stream.end("stop")
        calls = [c for d in deltas for c in d.get("tool_calls", ())]
        content = "".join(d.get("content", "") for d in deltas)
        if not calls:
            return text, []
        # (the text around the calls as streamed; none where only whitespace separates them)
        return content if content.strip() else None, [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return text, []


def finish_reason(p: ToolPlan, reason: str, calls: bool) -> str:
    """OpenAI's: `tool_calls` when the model chose to call (auto, required), `stop` for a named call."""
    return "tool_calls" if calls and reason != "length" and p.mode in ("auto", "required") else reason


class ToolStream:
    """One streamed choice's deltas: text in, OpenAI's delta objects out (`content`, or `tool_calls` entries)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, p: ToolPlan) -> None:
        self.plan = p
        self.buf = ""  # hermes: the text not yet sent
        self.scan = 0  # hermes: where in `buf` the end tag may begin (before it, it is not)
        self.held: list[str] = []  # required, llama3_json: the text held back (joined at the end, once)
        self.calls = 0  # tool calls sent
        self.in_call = False  # auto: inside <tool_call> (llama3_json: the answer is calls)
        self.plain = False  # llama3_json: the answer is content
        self.header = False  # named: the call's id and name sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        mode = self.plan.mode
        if mode == "named":
            if self.header:
                return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
            self.header, self.calls = True, 1
            call = _call(self.plan.name, text)  # type: ignore[arg-type]
            return [{"tool_calls": [{"index": 0, **call}]}]
        if mode == "required":
            self.held.append(text)
            return []
        if mode == "auto" and self.plan.parser == "llama3_json":
            return self._auto_json(text)
        if mode == "auto":
            self.buf += text
            return self._auto()
        return [{"content": text}] if text else []

    def end(self, reason: str) -> list[dict[str, Any]]:
        """The deltas still held back when the answer ended."""
        mode, out = self.plan.mode, []
        if mode == "required":
            text = "".join(self.held)
            calls = _calls_of_list(text)
            if calls is None:
                out = [{"content": text}] if text else []
            else:
                self.calls = len(calls)
                out = [{"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}]
        elif mode == "auto" and self.plan.parser == "llama3_json":
            text = "".join(self.held)
            calls = _json_calls(text, self.plan.names) if self.in_call else None
            if calls is None:
                out = [{"content": text}] if text else []
            else:
                out = [self._sent(c) for c in calls[: None if self.plan.parallel else 1]]
        elif mode == "auto" and (self.buf or self.in_call):
            call = _hermes_call(self.buf) if self.in_call else None  # (an unclosed call at the end)
            out = ([] if self._one_too_many() else [self._sent(call)]) if call is not None else [
                {"content": (self.START if self.in_call else "") + self.buf}]
        self.buf, self.held = "", []
        return out

    def _auto(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                i = self.buf.find(self.START)
                if i < 0:  # all of it is content, but an end that could begin the tag
                    keep = next((k for k in range(min(len(self.START) - 1, len(self.buf)), 0, -1)
                                 if self.START.startswith(self.buf[-k:])), 0)
                    if len(self.buf) > keep:
                        out.append({"content": self.buf[: len(self.buf) - keep]})
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if i:
                    out.append({"content": self.buf[:i]})
                self.buf, self.in_call, self.scan = self.buf[i + len(self.START):], True, 0
            j = self.buf.find(self.END, self.scan)
            if j < 0:  # (a long call is searched once, not again with each token)
                self.scan = max(0, len(self.buf) - len(self.END) + 1)
                return out
            body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(self.END):], False
            call = _hermes_call(body)
            if call is not None and self._one_too_many():
                continue
            out.append(self._sent(call) if call is not None else {"content": self.START + body + self.END})

    def _auto_json(self, text: str) -> list[dict[str, Any]]:
        """llama3_json: an answer whose text begins with `{` is calls, which come whole at its end; any other streams
        as content."""
        if self.plain:
            return [{"content": text}] if text else []
        self.held.append(text)
        if self.in_call or not (head := text.lstrip()):  # (until then, all of it is whitespace)
            return []
        self.in_call, self.plain = head[0] == "{", head[0] != "{"
        if self.in_call:
            return []
        out, self.held = [{"content": "".join(self.held)}], []
        return out

    def _one_too_many(self) -> bool:
        """`parallel_tool_calls: false` allows one call: the model's later ones are dropped (as OpenAI's model makes
        none)."""
        return not self.plan.parallel and self.calls >= 1

    def _sent(self, call: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {"tool_calls": [{"index": self.calls - 1, **call}]}
