"""OpenAI's Responses API (service/openai_responses.py) through the official `openai` client against a real server
(the tiny model under a template that shows tools): a response is the chat turn its instructions and input make, whole
or streamed as typed events the client's stream helper accepts; stored responses continue by id, are read and
deleted; function tools, text formats and logprobs; what it cannot serve is refused, naming the field."""
from __future__ import annotations

import json
import tracemalloc

import httpx
import jsonschema
import msgspec
import openai
import pytest

from service.app import build_app
from service.config import ServerConfig
from service.response_store import _ENTRY, ResponseStore, TooLong
from service.openai_schema import _Message
from tests.service.conftest import in_process
from tests.service.test_openai_tools import WEATHER

MODEL = "responses-model"
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
# the tiny model's random weights never end an answer: a regex makes one that does (its end, the end token's)
ENDS = {"guided_regex": r"Hello( big| small){0,3} world\."}


@pytest.fixture(scope="module")
def server(tools_model_dir):
    config = ServerConfig(model=str(tools_model_dir), served_model_name=MODEL, num_kv_blocks=256, max_model_len=1024,
                          engine_process=False, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with in_process(build_app(config), "responses-server") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(client: openai.OpenAI, **kw):
    """The stream's event types and the response the client's helper put together from its events."""
    with client.responses.stream(model=MODEL, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return [e.type for e in events], final


def test_a_response_is_the_chat_turn_its_input_makes(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Tell me about rivers.",
                                max_output_tokens=12, temperature=0,
                                reasoning={"effort": None, "summary": "auto"})  # (no effort: neutral, accepted)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about rivers."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # (cut at 12 tokens)
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.instructions == "Be brief."
    # input as items: messages with text parts say the same, the parts joined by newlines (as vLLM joins them)
    items = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=12, temperature=0, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about"},
                                                        {"type": "input_text", "text": "rivers."}]}])
    lines = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=12, temperature=0,
                                    input="Tell me about\nrivers.")
    assert items.output_text == lines.output_text


def test_a_stream_sends_the_events_the_client_puts_together(client: openai.OpenAI) -> None:
    kw = dict(input="Say hello.", max_output_tokens=30, temperature=0, extra_body=ENDS)
    whole = client.responses.create(model=MODEL, **kw)
    types, final = _streamed(client, **kw)
    assert whole.status == final.status == "completed" and final.output_text == whole.output_text
    assert whole.output_text.startswith("Hello") and whole.output_text.endswith("world.")
    deltas = types.count("response.output_text.delta")
    assert deltas >= 2 and types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert final.usage.output_tokens == whole.usage.output_tokens
    # cut short: the last event says so (the client's helper only finishes a completed response)
    with client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=3, stream=True) as events:
        last = list(events)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 3


def test_stored_responses_continue_and_can_be_read_and_deleted(client: openai.OpenAI, server) -> None:
    first = client.responses.create(model=MODEL, input="Name a river.", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=MODEL, input="And another.", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Name a river."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another."}])
    assert second.previous_response_id == first.id and second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with httpx.Client(base_url=f"{server.url}/v1", timeout=60) as http:
        r = http.get(f"/responses/{first.id}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
        assert http.delete(f"/responses/{first.id}").status_code == 404
        # a conversation whose turn is gone cannot go on
        r = http.post("/responses", json={"model": MODEL, "input": "More.", "previous_response_id": second.id})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
        assert "earlier turn" in r.json()["error"]["message"], r.text  # (the response itself is still there)
        # store false: answered, not kept
        r = http.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False})
        assert r.status_code == 200 and r.json()["store"] is False
        assert http.get(f"/responses/{r.json()['id']}").status_code == 404


def test_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    kw = dict(input="What is the weather in Paris?", tools=[TOOL], max_output_tokens=100, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(model=MODEL, **kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    types, final = _streamed(client, **kw)
    assert [(c.type, c.name, c.arguments) for c in final.output] == [("function_call", "get_weather", call.arguments)]
    assert types[2] == "response.output_item.added" and types[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    # the call's output goes back in the next turn, after the stored call (the tools are each request's own)
    again = dict(tools=[TOOL], tool_choice="none", max_output_tokens=4, temperature=0)
    answer = client.responses.create(model=MODEL, previous_response_id=r.id, **again, input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "21 degrees and sunny"}])
    assert answer.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    # the same conversation given whole, without the store
    whole = client.responses.create(model=MODEL, **again, store=False, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees and sunny"}])
    assert (whole.output_text, whole.usage.input_tokens) == (answer.output_text, answer.usage.input_tokens)


def test_text_format_and_logprobs(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"river": {"enum": ["Nile", "Rhine"]}}, "required": ["river"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A river?", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "river", "schema": schema}},
                                include=["message.output_text.logprobs"], top_logprobs=2)
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.status == "completed"
    lps = r.output[0].content[0].logprobs
    # every token's, the end token's last (named, as chat's logprobs name it)
    assert "".join(e.token for e in lps[:-1]) == r.output_text and lps[-1].token == "<|im_end|>"
    assert len(lps) == r.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in lps)
    # (a response with logprobs is made on the tokenizer thread: stored all the same)
    assert client.responses.retrieve(r.id).output[0].content[0].logprobs == lps
    _, final = _streamed(client, input="A river?", max_output_tokens=60, temperature=0, top_logprobs=2,
                         text={"format": {"type": "json_schema", "name": "river", "schema": schema}})
    assert [e.token for e in final.output[0].content[0].logprobs] == [e.token for e in lps]


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # (no --reasoning-parser: the model does not reason)
    ({"reasoning": {"effort": "none", "summary": 5}}, "reasoning.summary"),
    ({"reasoning": "high"}, "reasoning"),
    ({"n": 2}, "n"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),  # (more than the context leaves: named as the API names it)
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x" * 70_000}, "input"),  # (longer than the context could ever hold)
])
def test_what_cannot_be_served_is_refused(server, extra: dict, param: str) -> None:
    with httpx.Client(base_url=f"{server.url}/v1", timeout=60) as http:
        r = http.post("/responses", json={"model": MODEL, "input": "Hi", **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if param == "max_output_tokens":  # (the message names it so too)
        assert "max_output_tokens" in r.json()["error"]["message"] and "max_tokens" not in r.text, r.text


def test_the_store_keeps_what_its_bound_holds() -> None:
    """Least recently used out first; a conversation one of whose turns is gone has no history; a response larger than
    the whole store is not kept."""
    store = ResponseStore(max_bytes=2_000 + 11 * _ENTRY)  # (11 of the responses below)

    def put(i: str, previous: str | None = None, size: int = 100) -> None:
        store.put(i, b"x" * size, [_Message("user", i)], previous)

    put("a")
    put("b", "a")
    assert [m.content for m in store.conversation("b", 10)] == ["a", "b"]
    with pytest.raises(TooLong):  # (more messages than the context has tokens: not walked further)
        store.conversation("b", 1)
    for i in range(12):  # ~150 bytes each: "a" goes first, then "b"
        put(f"c{i}")
        store.get("b")  # (b is used: a, the oldest, goes first)
    assert store.get("a") is None and store.conversation("b", 10) is None and store.get("b") is not None
    put("huge", size=store.max_bytes)
    assert store.get("huge") is None
    assert store.delete("c11") and not store.delete("c11")


def test_the_store_holds_no_more_memory_than_its_bound() -> None:
    """What the store counts is what it holds: turns of many short messages (objects would take 2-4x their JSON) and
    many small responses each from a client of its own (their records and orders) stay within the bound."""
    def turn(n: int) -> list[_Message]:  # (as a request's body decodes: objects of their own)
        return msgspec.json.decode(json.dumps([{"role": "user", "content": "a"}] * n), type=list[_Message])

    tracemalloc.start()
    try:
        for size, owners, puts in ((2_000, 1, 100), (2, 10_000, 10_000)):
            store = ResponseStore(max_bytes=4 << 20)
            before = tracemalloc.get_traced_memory()[0]
            for i in range(puts):
                store.put(f"resp_{i:032x}", json.dumps({"id": f"resp_{i:032x}"}).encode() * 2, turn(size),
                          f"resp_{i - 1:032x}" if i else None, f"10.0.{i % owners // 256}.{i % owners % 256}")
                if store._bytes < store.max_bytes * 0.9:
                    continue
                held = tracemalloc.get_traced_memory()[0] - before
                assert held <= store.max_bytes, (size, owners, held)
            assert store.get(f"resp_{i:032x}").turn == turn(size)
            del store
    finally:
        tracemalloc.stop()


def test_a_client_that_fills_the_store_evicts_its_own_responses() -> None:
    """A full store makes room from the client holding the most: alone, one fills it all; beside it, a client storing
    one response after another pushes out its own oldest, never the other's conversation, once it holds the most."""
    store = ResponseStore(max_bytes=10 * (200 + _ENTRY))

    def put(owner: str, i: int, previous: int | None = None) -> None:  # 200 bytes each and _ENTRY: the store holds 10
        store.put(f"{owner[0]}{i:02d}", b"x" * 117, [_Message("user", f"{i:03d}")],
                  None if previous is None else f"{owner[0]}{previous:02d}", owner)

    def flood() -> list[int]:
        return [i for i in range(100) if store.get(f"f{i:02d}") is not None]

    for i in range(10):
        put("flood", i)
    assert flood() == list(range(10))  # alone: the whole store
    for i in range(3):
        put("chat", i, i - 1 if i else None)
    for i in range(10, 60):
        put("flood", i)
    assert len(store.conversation("c02", 10)) == 3 and flood() == list(range(53, 60))  # its newest, in what is left
    put("chat", 3, 2)  # (the flood holds the most: room comes from it, not from the chat's oldest)
    assert len(store.conversation("c03", 10)) == 4 and flood() == list(range(54, 60))
    assert all(store.delete(f"c{i:02d}") for i in range(4))
    for i in range(60, 70):  # (the chat gone: the flood may have it all again)
        put("flood", i)
    assert flood() == list(range(60, 70))


def test_a_stored_response_is_its_clients(server) -> None:
    """The store knows each response by the address of the client that made it (whose share it takes)."""
    ids = {}
    for address in ("127.0.0.1", "127.0.0.2"):
        with httpx.Client(base_url=f"{server.url}/v1", timeout=60,
                          transport=httpx.HTTPTransport(local_address=address)) as http:
            r = http.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
            assert r.status_code == 200, r.text
            ids[address] = r.json()["id"]
    store = server.app.state.service.responses
    assert {address: store.get(i).owner for address, i in ids.items()} == {a: a for a in ids}


def test_whole_and_streamed_answers_make_the_same_items(client: openai.OpenAI, server) -> None:
    """With tools the model may call (auto), the items come in the order the answer makes them, whole or streamed:
    its text, then its call; whitespace alone around a call makes no message. Every body is what the client's types
    require (validated strictly)."""
    from openai.types.responses import Response as SDKResponse

    regex = r'Hi there <tool_call>\{"name": "get_weather", "arguments": \{"city": "Rome", "unit": "C"\}\}</tool_call>\n'
    kw = dict(input="Weather?", tools=[TOOL], max_output_tokens=100, extra_body={**ENDS, "guided_regex": regex})
    whole = client.responses.create(model=MODEL, **kw)
    _, streamed = _streamed(client, **kw)
    for r in (whole, streamed):
        assert [(i.type, getattr(i, "name", None)) for i in r.output] == [("message", None),
                                                                          ("function_call", "get_weather")]
        assert r.output[0].content[0].text == "Hi there " and r.status == "completed"
    assert streamed.output[1].arguments == whole.output[1].arguments
    with httpx.Client(base_url=f"{server.url}/v1", timeout=60) as http:
        raw = http.post("/responses", json={"model": MODEL, **{k: v for k, v in kw.items() if k != "extra_body"},
                                            **kw["extra_body"], "stream_options": {"include_obfuscation": False}})
        assert raw.status_code == 200, raw.text
        SDKResponse.model_validate(raw.json(), strict=True)
        # streamed too (the Responses API's own stream_options, not chat's)
        raw = http.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True,
                                            "stream_options": {"include_obfuscation": False}})
        assert raw.status_code == 200, raw.text
        assert raw.text.split("\n\n")[-2].startswith("event: response.incomplete"), raw.text  # (cut at 2 tokens)


def test_a_call_cut_off_still_lets_the_conversation_go_on(client: openai.OpenAI) -> None:
    """A named call cut off by max_output_tokens is in the output as far as it got; its conversation keeps it with
    `{}` for arguments (what a chat template can show), so the next turn still goes."""
    r = client.responses.create(model=MODEL, input="Weather?", tools=[TOOL], max_output_tokens=4,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert r.status == "incomplete" and call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    after = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[TOOL], tool_choice="none",
                                    max_output_tokens=2, input=[{"type": "function_call_output",
                                                                 "call_id": call.call_id, "output": "sunny"}])
    assert after.status == "incomplete" and after.usage.input_tokens > r.usage.input_tokens


def test_tokenize_refuses_a_flood_before_tokenizing(server) -> None:
    """(This module's server has a 1,024-token context and the default body limit.) /tokenize counts a prompt over
    the context, but one whose lower bound on tokens fills four contexts is refused before the tokenizer sees it, as
    a completion's is; max_tokens 0 leaves no room for min_tokens."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/tokenize", json={"prompt": "word " * 1000})
        assert r.status_code == 200 and r.json()["count"] > 1024, r.text
        for body in ({"prompt": "x" * 70_000}, {"messages": [{"role": "user", "content": "x"}] * 30_000}):
            r = http.post("/tokenize", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0, "echo": True,
                                               "min_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_a_stored_responses_input_items(client: openai.OpenAI, server) -> None:
    """GET /v1/responses/{id}/input_items (the client's `responses.input_items.list`): the items of its input, as
    the client's types read them, newest first unless asked, a page at a time."""
    from openai.types.responses import ResponseItemList

    given = [{"type": "message", "role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                             {"type": "input_text", "text": "in Rome?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "assistant", "content": "It is sunny."},
             {"role": "user", "content": "Thanks!"}]
    r = client.responses.create(model=MODEL, input=given, tools=[TOOL], max_output_tokens=2)
    items = client.responses.input_items.list(r.id, order="asc")
    seen = [(i.type, getattr(i, "role", None)) for i in items.data]
    assert seen == [("message", "developer"), ("message", "user"), ("function_call", None),
                    ("function_call_output", None), ("message", "assistant"), ("message", "user")]
    assert items.data[1].content[0].text == "Weather\nin Rome?" and items.data[2].arguments == '{"city": "Rome"}'
    assert items.data[3].output == "sunny" and items.data[4].content[0].text == "It is sunny."
    assert not items.has_more and (items.first_id, items.last_id) == (items.data[0].id, items.data[-1].id)
    newest = client.responses.input_items.list(r.id)  # (desc: the last first)
    assert [i.id for i in newest.data] == [i.id for i in reversed(items.data)]
    with httpx.Client(base_url=f"{server.url}/v1", timeout=60) as http:
        page = http.get(f"/responses/{r.id}/input_items", params={"limit": 2, "order": "asc"}).json()
        ResponseItemList.model_validate(page, strict=True)
        assert [i["id"] for i in page["data"]] == [i.id for i in items.data[:2]] and page["has_more"]
        rest = http.get(f"/responses/{r.id}/input_items",
                        params={"limit": 10, "order": "asc", "after": page["last_id"]}).json()
        assert [i["id"] for i in rest["data"]] == [i.id for i in items.data[2:]] and not rest["has_more"]
        for params, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                              ({"after": "msg_nope"}, "after"), ({"include": "message.output_text.logprobs"},
                                                                 "include")):
            bad = http.get(f"/responses/{r.id}/input_items", params=params)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        assert http.get("/responses/resp_nope/input_items").status_code == 404
    # a plain string input is one user message
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    (only,) = client.responses.input_items.list(r.id).data
    assert (only.role, only.content[0].text) == ("user", "Hi")
