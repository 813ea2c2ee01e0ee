"""Tool calling on chat completions (service/openai_tools.py): the plan a request's tools and tool_choice make, the
hermes parser against text cut anywhere, and a real server (the tiny model under a template that shows tools) whose
named, required and auto answers come back as calls, streamed and not, through the official `openai` client."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import msgspec
import openai
import pytest

from service.app import build_app
from service.config import ServerConfig
from service.openai_errors import HTTPError
from service.openai_tools import NamedToolChoice, Tool, ToolStream, answer, plan
from tests.service.conftest import in_process

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tools(*names: str) -> list[Tool]:
    return msgspec.convert([t for t in TOOLS if not names or t["function"]["name"] in names], list[Tool])


def test_required_moves_each_tools_definitions_to_the_root() -> None:
    """Pydantic's schemas (`openai.pydantic_function_tool`) reference nested models and enums in `$defs`: under
    `required` each tool's move to the list's root, where the references point; two tools that define one name
    differently are refused."""
    unit = {"enum": ["C", "F"]}
    tools = msgspec.convert([{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
        "$defs": {"Unit": unit}}}}, {"type": "function", "function": {"name": "u", "parameters": {
            "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}}}], list[Tool])
    schema = json.loads(plan(tools, "required", None, None).structured_output.spec)
    assert schema["$defs"] == {"Unit": unit}
    jsonschema.validate([{"name": "t", "parameters": {"unit": "F"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "t", "parameters": {"unit": "K"}}], schema)
    tools[1].function.parameters["$defs"] = {"Unit": {"enum": ["K"]}}
    with pytest.raises(HTTPError) as e:
        plan(tools, "required", None, None)
    assert e.value.param == "tools"


def test_earlier_calls_arguments_must_be_a_json_object() -> None:
    from service.openai_tools import template_messages

    for args in ("[1]", "{nope", "[" * 5000 + "]" * 5000):  # (the last nests deeper than a body may: not a 500)
        with pytest.raises(HTTPError) as e:
            template_messages([{"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}])
        assert e.value.param == "messages[0].tool_calls[0].function.arguments"


def test_the_plan_of_each_choice() -> None:
    assert plan(None, None, None, None).mode == "none"
    named = plan(_tools(), msgspec.convert({"type": "function", "function": {"name": "get_time"}}, NamedToolChoice),
                 None, None)
    assert named.mode == "named" and named.name == "get_time"
    assert json.loads(named.structured_output.spec) == TIME and named.structured_output.param == "tool_choice"
    required = plan(_tools(), "required", False, None)
    schema = json.loads(required.structured_output.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Paris", "unit": "C"}}], schema)
    assert plan(_tools(), "auto", None, "hermes").parser == "hermes"
    assert [t["function"]["name"] for t in plan(_tools(), "none", None, None).tools] == ["get_weather", "get_time"]
    for tools, choice, param in ((None, "required", "tool_choice"), (_tools(), None, "tool_choice"),  # auto: no parser
                                 (_tools(), "sometimes", "tool_choice"),
                                 (_tools("get_time") * 2, "required", "tools[1].function.name")):
        with pytest.raises(HTTPError) as e:
            plan(tools, choice, None, None)
        assert e.value.param == param and e.value.status == 400


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'


@pytest.mark.parametrize("text", [
    CALL, "Let me look. " + CALL, CALL + CALL.replace("Rome", "Oslo"), "no call at all <tool", "<tool_call>{nope}</tool_call>",
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',  # cut off before its end tag
    CALL + " <tool_call>{oops}</tool_call>", CALL + "<tool_call>",  # a good call, then one that is not
    "<tool_call>" + "[" * 990,  # (deeper than a body may nest: text, not a RecursionError)
])
def test_hermes_streamed_anyhow_gives_the_whole_answer(text: str) -> None:
    """The hermes parser fed the answer one character at a time, or in pieces that split the tags, sends the content
    and calls the whole answer has: no tag text leaks, nothing is lost."""
    p = plan(_tools(), "auto", None, "hermes")
    content, calls = answer(p, text)
    for size in (1, 3, 7, len(text)):
        stream = ToolStream(p)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.end("stop")
        streamed = "".join(d.get("content", "") for d in deltas)
        got = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in got] == list(range(len(got)))
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], (size, deltas)
        if calls:
            # (a good call's tags never: a bad block's stay as text; the same text both ways, none where only
            # whitespace was left around the calls)
            assert streamed == content if content is not None else not streamed.strip()
            assert (content or "").count("<tool_call>") == text.count("<tool_call>") - len(calls)
        else:
            assert streamed == text == content


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    """`parallel_tool_calls: false` under auto: the model's first call only, whole or streamed in any pieces; the text
    around it stays."""
    p = plan(_tools(), "auto", False, "hermes")
    text = "Looking. " + CALL + CALL.replace("Rome", "Oslo") + " done"
    content, calls = answer(p, text)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Rome"] and content == "Looking.  done"
    for size in (1, 5):
        stream = ToolStream(p)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.end("stop")
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", ())] == ["get_weather"]
    unclosed = answer(p, CALL + '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}')[1]
    assert [c["function"]["name"] for c in unclosed] == ["get_weather"]


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}'


@pytest.mark.parametrize("text, cities", [
    (LLAMA_CALL, ["Rome"]), (" \n" + LLAMA_CALL + "; " + LLAMA_CALL.replace("Rome", "Oslo"), ["Rome", "Oslo"]),
    ("It is sunny in Rome.", []), (LLAMA_CALL + " and then some text", []), ('{"city": "Rome"}', []),
    (LLAMA_CALL[:-3], []),  # cut off
    ('{"name": "Alice", "parameters": {"age": 30}}', []),  # (not one of the tools: JSON the answer holds)
    ('{"name": "get_weather", "age": 30}', []),  # (no arguments: not a call)
    ("\n" * 50 + "It is sunny.", []),
    ("{" * 990, []),  # (deeper than a body may nest: text, not a RecursionError)
])
def test_llama3_json_streamed_anyhow(text: str, cities: list[str]) -> None:
    """llama3_json (Llama 3.1-3.3's format): an answer that is wholly `{"name", "parameters"}` objects is calls, any
    other its text, whole or streamed in any pieces; `parallel_tool_calls: false` keeps the first."""
    for parallel in (None, False):
        p = plan(_tools(), "auto", parallel, "llama3_json")
        content, calls = answer(p, text)
        want = cities if parallel is None else cities[:1]
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == want
        assert content == (None if cities else text)
        for size in (1, 4, len(text)):
            stream = ToolStream(p)
            deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.end("stop")
            assert "".join(d.get("content", "") for d in deltas) == ("" if cities else text)
            assert [json.loads(c["function"]["arguments"])["city"] for d in deltas for c in d.get("tool_calls", ())] \
                == want


@pytest.fixture(scope="module")
def server(tools_model_dir: Path):
    config = ServerConfig(model=str(tools_model_dir), served_model_name="tools-model", num_kv_blocks=256, max_model_len=1024, engine_process=False,
                          enable_auto_tool_choice=True, tool_call_parser="hermes")
    with in_process(build_app(config), "tools-server") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(client: openai.OpenAI, **kw) -> tuple[str | None, list[tuple[str, str]], str]:
    """A streamed answer's content, calls (name, arguments: their deltas joined) and finish reason."""
    content, calls, reason = None, {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        (c,) = chunk.choices
        if c.delta.content:
            content = (content or "") + c.delta.content
        for t in c.delta.tool_calls or ():
            if t.id:  # a call's first delta: its id and name
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
        reason = c.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    kw = dict(model="tools-model", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=3,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    (c,) = r.choices
    (call,) = c.message.tool_calls
    assert c.finish_reason == "stop" and c.message.content is None and call.type == "function"
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert _streamed(client, **kw) == (None, [("get_weather", call.function.arguments)], "stop")
    # logprobs: every token's, streamed too (the end token's has no text to ride with: it comes with the finish)
    whole = client.chat.completions.create(**kw, logprobs=True).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**kw, logprobs=True, stream=True)
                for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in whole] and len(whole) == r.usage.completion_tokens


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    kw = dict(model="tools-model", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=300, seed=5)
    r = client.chat.completions.create(**kw)
    (c,) = r.choices
    (call,) = c.message.tool_calls
    assert c.finish_reason == "tool_calls" and c.message.content is None
    schema = WEATHER if call.function.name == "get_weather" else TIME
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert _streamed(client, **kw) == (None, [(call.function.name, call.function.arguments)], "tool_calls")


def test_auto_parses_the_models_calls(client: openai.OpenAI) -> None:
    """With `auto` the model decides: its text is parsed for hermes calls. The tiny model's random weights never
    write one, so a regex writes it for them (structured output beside auto: the answer's text, parsed after)."""
    regex = (r'I will check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "C"\}\}'
             r'</tool_call>')
    kw = dict(model="tools-model", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=1,
              extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**kw)
    (c,) = r.choices
    (call,) = c.message.tool_calls
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check. "  # (as streamed)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "C"
    content, calls, reason = _streamed(client, **kw)
    assert (content, calls, reason) == ("I will check. ", [("get_weather", call.function.arguments)],
                                                "tool_calls")
    # none: the same text is the answer's, unparsed
    r = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_tools_and_earlier_calls_reach_the_template(server, client: openai.OpenAI) -> None:
    """The tools, an assistant's earlier calls (their arguments a mapping) and the tools' results are written into
    the prompt by the model's template: each adds to its tokens."""
    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model="tools-model", max_tokens=1, **kw).usage.prompt_tokens

    turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    plain = prompt_tokens(messages=MESSAGES)
    assert prompt_tokens(messages=MESSAGES, tools=TOOLS, tool_choice="none") > plain + 40  # (the tools' JSON)
    assert prompt_tokens(messages=turn) > plain + 20
    with httpx.Client(base_url=server.url, timeout=60) as http:
        # tools count toward the cheap bound on a prompt's size, checked before any templating
        r = http.post("/v1/chat/completions", json={"model": "tools-model", "messages": MESSAGES, "tools": [
            {"type": "function", "function": {"name": "f", "description": "x" * 70_000}}], "tool_choice": "none"})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        for extra, param in (({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                               "tool_choice"),  # (two things holding the answer)
                              ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                               "tool_choice")):
            r = http.post("/v1/chat/completions", json={"model": "tools-model", "messages": MESSAGES, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_template_kwargs_and_documents_reach_the_template(server, client: openai.OpenAI) -> None:
    """vLLM's `chat_template_kwargs` (Qwen3's `enable_thinking`, say) and `documents` are the template's to write; a
    key that would set one of the template's own arguments is refused."""
    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model="tools-model", messages=MESSAGES, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(documents=[{"title": "Rivers", "text": "The Nile is long."}]) > plain + 5
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for kwargs in ({"add_generation_prompt": False}, {"tools": []}, {"not a name": 1}):
            r = http.post("/v1/chat/completions", json={"model": "tools-model", "messages": MESSAGES,
                                                        "chat_template_kwargs": kwargs})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        r = http.post("/v1/chat/completions", json={"model": "tools-model", "messages": MESSAGES, "chat_template": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text


def test_llama3_json_server_parses_the_models_calls(tools_model_dir: Path) -> None:
    """--tool-call-parser llama3_json: an answer that is a call comes back as one, from chat completions and the
    Responses API, whole and streamed (a regex writes it for the tiny model's random weights)."""
    regex = r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "unit": "C"\}\}'
    config = ServerConfig(model=str(tools_model_dir), served_model_name="llama", num_kv_blocks=256, max_model_len=1024,
                          engine_process=False, enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    with in_process(build_app(config), "llama-tools-server") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="llama", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=1,
                  extra_body={"guided_regex": regex})
        (c,) = client.chat.completions.create(**kw).choices
        (call,) = c.message.tool_calls
        assert c.finish_reason == "tool_calls" and c.message.content is None and call.function.name == "get_weather"
        assert _streamed(client, **kw) == (None, [("get_weather", call.function.arguments)], "tool_calls")
        r = client.responses.create(model="llama", input=MESSAGES[0]["content"], max_output_tokens=200,
                                    tools=[{"type": "function", **TOOLS[0]["function"]}],
                                    extra_body={"guided_regex": regex, "seed": 1})
        (item,) = r.output
        assert (item.type, item.name, item.arguments) == ("function_call", "get_weather", call.function.arguments)
