"""`--reasoning-parser` (service/openai_reasoning.py): a reasoning model's `<think>` text apart from its content, cut
anywhere when streamed; through a real server (the tiny model, a regex writing a reasoning answer for it), chat
completions' `reasoning_content` and the Responses API's reasoning item, whole and streamed alike, with tools; the
WebSocket chat's `reasoning` deltas."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from transformers import AutoTokenizer

from service.app import build_app
from service.config import ServerConfig
from service.handle import RequestHandle
from service.openai_reasoning import ThinkStream, split
from service.openai_render import ChatRender
from tests.service.conftest import check_chat_frames, collect, in_process, open_ws, send
from tests.service.test_openai_tools import MESSAGES, TOOLS


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("deepseek_r1", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("deepseek_r1", "<think>Let me see.</think>\n\nIt is 4.", "Let me see.", "\n\nIt is 4."),
    ("deepseek_r1", "Still thinking, cut off", "Still thinking, cut off", ""),
    ("deepseek_r1", "</think>Straight away.", None, "Straight away."),
    ("deepseek_r1", "a </thin", "a </thin", ""),  # (a closing tag cut off stays reasoning)
    ("qwen3", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("qwen3", "  <think>x</think>y", "x", "y"),
    ("qwen3", "It is 4, no thinking.", None, "It is 4, no thinking."),
    ("qwen3", "It is 4 </think> odd", None, "It is 4 </think> odd"),  # (no opening: all content)
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "", None, ""),
])
def test_split_in_any_pieces(parser: str, text: str, reasoning: str | None, content: str) -> None:
    assert split(parser, text)[:2] == (reasoning, content)
    for size in (1, 2, 5):
        stream = ThinkStream(parser)
        parts = [p for i in range(0, len(text), size) for p in stream.feed(text[i:i + size])] + stream.end()
        assert "".join(t for k, t, _ in parts if k == "reasoning") == (reasoning or "")
        assert "".join(t for k, t, _ in parts if k == "content") == content


def test_where_each_part_ends() -> None:
    """A part's end is where its text ends in the answer (a tag's characters before the next part's), so a token's
    logprobs go with the part its text is in."""
    stream = ThinkStream("deepseek_r1")
    assert stream.feed("ab</th") == [("reasoning", "ab", 2)]
    assert stream.feed("ink>cd") == [("content", "cd", 12)]
    stream = ThinkStream("qwen3")
    assert stream.feed("  <th") == [] and stream.feed("ink>x</think>y") == [("reasoning", "x", 10),
                                                                              ("content", "y", 19)]
    stream = ThinkStream("qwen3")  # a long opening of whitespace is held apart (never stripped again), then given
    assert all(stream.feed(" ") == [] for _ in range(10_000)) and not stream.head
    assert stream.feed("Hi") == [("content", " " * 10_000 + "Hi", 10_002)]


@pytest.mark.parametrize("kwargs, text, reasoning, content", [
    # an answer held to a grammar from its first token: no template opened <think> for it
    ({"opened": False}, "It is 4.", None, "It is 4."),
    ({"opened": False}, "<think>x</think>It is 4.", "x", "It is 4."),
    # continuing the last message: its text decides where the answer starts
    ({"prefix": "<think>Let me"}, " see.</think>It is 4.", " see.", "It is 4."),
    ({"prefix": "<think>Let me see.</th"}, "ink>It is 4.", None, "It is 4."),
    ({"prefix": "<think>Hm.</think>It"}, " is 4.", None, " is 4."),
    ({"prefix": "It"}, " is 4.", None, " is 4."),
    # what the continued message's end held back (a tag's start, whitespace) is not the answer's
    ({"prefix": "<think>compare a <"}, "b</think>ok", "b", "ok"),
    ({"prefix": " "}, "Hello", None, "Hello"),
    ({"prefix": "<"}, "b>bold</b>", None, "b>bold</b>"),
    ({"prefix": "\n"}, "", None, ""),
])
def test_answers_the_template_did_not_open(kwargs: dict, text: str, reasoning: str | None, content: str) -> None:
    opened = kwargs.pop("opened", "prefix" not in kwargs)
    assert split("deepseek_r1", text, opened=opened, **kwargs)[:2] == (reasoning, content)


def _lp(i: int, raw: bytes) -> tuple:
    return (i, raw.decode(errors="replace"), raw, -1.0, [])


def test_each_tokens_logprobs_go_with_its_part() -> None:
    """Streamed, a token's logprobs ride with the part its text ends in: one of no text (half a character, a special
    token) waits for the next part, never an empty content delta before the reasoning; the end token's follow the
    last part; whole, the same tokens are counted."""
    render = ChatRender("m", True, reasoning="deepseek_r1")
    steps = [("", [_lp(0, b"\xe2")]), ("\u20ac thinking</think>", [_lp(1, b"\x82\xac thinking</think>")]),
             ("Answer", [_lp(2, b"Answer")]), ("", [_lp(3, b"")])]
    chunks = [c for text, lps in steps for c in render.stream_delta(text, lps, False)]
    got = [(next(iter(c["choices"][0]["delta"].items())), [t["token"] for t in c["choices"][0]["logprobs"]["content"]])
           for c in chunks]
    assert got == [(("reasoning_content", "\u20ac thinking"), ["\ufffd"]),  # (the token ending in the tag: the next)
                   (("content", "Answer"), ["\ufffd\ufffd thinking</think>", "Answer"]), (("content", ""), [""])]


@pytest.mark.parametrize("parser, continued, echo, pieces, want", [
    ("deepseek_r1", None, False, ["I", " think", "</", "think>", "42"], 4),  # (through the push ending the tag)
    ("deepseek_r1", None, False, ["I", " think"], 2),  # never closed: all of it
    ("qwen3", None, False, ["4", "2"], 0),  # no reasoning
    ("qwen3", None, False, ["<think>", "hm", "</think>", "4"], 3),
    ("qwen3", "<think>abc</thi", False, ["nk>", "It", " is"], 1),  # the continued message holds the tag's start
    ("qwen3", "<think>abc</thi", True, ["nk>", "It", " is"], 1),  # (echoed too)
    ("qwen3", "<think>a</think>b", True, ["It", " is", " 4"], 0),  # closed in the message, not in the answer
    ("qwen3", "<think>a", False, ["b", "</think>", "c"], 2),
])
def test_reasoning_tokens_are_the_answers_through_its_closing_tag(parser, continued, echo, pieces, want) -> None:
    """An answer's reasoning tokens (usage's `reasoning_tokens`): those through the push that completes its closing tag
    (RequestHandle.watch), whole or streamed alike, wherever the tag starts; none of a reasoning the continued message
    closed."""
    for streamed in (False, True):
        render = ChatRender("m", False, reasoning=parser, continued=continued, opened=continued is None,
                            echo=continued if echo else "")
        h = RequestHandle("r", "chat", lambda: None)
        render.watch(h)
        chunks = render.stream_start(h, False) if streamed else []
        for piece in pieces:
            h.push(piece, 1, None)
            if streamed:
                chunks += render.stream_delta(*h.take()[::2], False)
        h.finish("stop", None)
        if streamed:
            render.stream_end(h, False)
        else:
            render.choice(h)
        assert h.reasoning_tokens == want, (streamed, pieces)


def test_an_echo_is_split_as_the_answer_it_leads() -> None:
    """`echo` with `continue_final_message`: the echoed message is the answer's start, split with it (a tag it leaves
    unfinished too), whole or streamed alike; without `continue_final_message` the echo leads the content as is."""
    for echo, text, want in [("<think>Let me", " see</think>42", ("Let me see", "42")),
                             ("<think>abc</th", "ink>x", ("abc", "x")), ("<think", ">a</think>b", ("a", "b")),
                             ("\n", "<think>a</think>b", ("a", "b")), ("Sure", ", 42", (None, "Sure, 42"))]:
        def render() -> ChatRender:
            return ChatRender("m", False, echo=echo, reasoning="deepseek_r1", continued=echo)

        h = RequestHandle("r", "chat", lambda: None)
        h.push(text, 3, None)
        h.finish("stop", None)
        message = render().choice(h)["message"]
        assert (message["reasoning_content"], message["content"]) == want, echo
        r = render()
        chunks = r.stream_start(h, False) + r.stream_delta(text, [], False) + r.stream_end(h, False)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == (want[0] or ""), echo
        assert "".join(d.get("content") or "" for d in deltas) == want[1], echo
    h = RequestHandle("r", "chat", lambda: None)
    h.push("Hm.</think>42", 3, None)
    h.finish("stop", None)
    message = ChatRender("m", False, echo="<think>old</think>Hi", reasoning="deepseek_r1").choice(h)["message"]
    assert (message["reasoning_content"], message["content"]) == ("Hm.", "<think>old</think>Hi42")


def test_reasoning_is_apart_in_chat_and_responses(tools_model_dir) -> None:
    """Under qwen3, with regexes that themselves open <think> (so they hold the whole answer) to write reasoning
    answers."""
    config = ServerConfig(model=str(tools_model_dir), served_model_name="r1", num_kv_blocks=256, max_model_len=1024,
                          engine_process=False, reasoning_parser="qwen3", enable_auto_tool_choice=True,
                          tool_call_parser="hermes")
    regex = r"<think>I add (two|three) and two\.</think>It is (4|5)\."
    with in_process(build_app(config), "reasoning-server") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="r1", messages=MESSAGES, max_tokens=100, logprobs=True, temperature=0,
                  extra_body={"guided_regex": regex})
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        reasoning = m.model_extra["reasoning_content"]
        assert reasoning.startswith("I add") and reasoning.endswith("two.") and m.content.startswith("It is")
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
        # its reasoning tokens: those through its closing tag's (OpenAI's completion_tokens_details), whole or streamed
        through = _tokens_through(r.choices[0].logprobs.content, "</think>")
        assert r.usage.completion_tokens_details.reasoning_tokens == through < r.usage.completion_tokens
        *_, last = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        assert last.usage.completion_tokens_details.reasoning_tokens == through
        streamed = {"reasoning_content": "", "content": ""}
        n_logprobs = 0
        for chunk in client.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed["content"] += delta.content or ""
            n_logprobs += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert streamed == {"reasoning_content": reasoning, "content": m.content} and n_logprobs == len(
            r.choices[0].logprobs.content)
        # each token's logprobs ride with the part its text ends in (the tags' with the next part)
        tokens = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**kw, stream=True):
            kind = "reasoning_content" if (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") else (
                "content")
            tokens[kind] += "".join(t.token for t in chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs \
                else ""
        assert tokens["reasoning_content"] == "<think>" + reasoning
        assert tokens["content"].startswith("</think>" + m.content)  # (and the end token's)
        # an answer that does not open <think> is held by its grammar from its start (no "<": by construction)
        tok = AutoTokenizer.from_pretrained(tools_model_dir)
        no_tag = {str(i): -100 for i in range(len(tok)) if tok.decode([i]).startswith("<")}
        held = client.chat.completions.create(model="r1", messages=MESSAGES, max_tokens=20, logit_bias=no_tag,
                                              extra_body={"guided_regex": r"It is (4|5)\."}).choices[0].message
        assert held.model_extra["reasoning_content"] is None and held.content.startswith("It is")
        # the tools parse the content, not the reasoning
        call = r'<think>I should call it\.</think><tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
        r = client.chat.completions.create(model="r1", messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                           extra_body={"guided_regex": call})
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "I should call it." and m.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_time",
                                                                                                 {"zone": "UTC"})]
        # the Responses API: a reasoning item, then the message; streamed the same
        kw = dict(model="r1", input="What is two and two?", max_output_tokens=100, temperature=0,
                  include=["message.output_text.logprobs"], reasoning={"effort": "high", "summary": "auto"},
                  extra_body={"guided_regex": regex})
        whole = client.responses.create(**kw)
        with client.responses.stream(**kw) as stream:
            types = [e.type for e in stream]
            final = stream.get_final_response()
        for resp in (whole, final):
            assert [i.type for i in resp.output] == ["reasoning", "message"]
            assert resp.output[0].content[0].text.endswith("two.") and resp.output_text.startswith("It is")
        assert final.output[0].content[0].text == whole.output[0].content[0].text
        # the text's logprobs are the message's tokens' (from its closing tag on), whole or streamed alike
        for resp in (whole, final):
            assert "".join(t.token for t in resp.output[1].content[0].logprobs).startswith("</think>" + resp.output_text)
            assert resp.reasoning.effort == "high"  # (accepted with a reasoning parser: the template's to read)
        assert [t.token for t in final.output[1].content[0].logprobs] == [
            t.token for t in whole.output[1].content[0].logprobs]
        assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
        # its reasoning tokens: those before the message's (whose first tokens are the closing tag's)
        tag = _tokens_through(whole.output[1].content[0].logprobs, "</think>")
        for resp in (whole, final):
            assert resp.usage.output_tokens_details.reasoning_tokens == (
                resp.usage.output_tokens - len(resp.output[1].content[0].logprobs) + tag)
        # its reasoning given back as an input item is left out of the next prompt
        again = client.responses.create(model="r1", max_output_tokens=1, store=False, input=[
            {"role": "user", "content": "What is two and two?"}, whole.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": whole.output_text}, {"role": "user", "content": "Sure?"}])
        plain = client.responses.create(model="r1", max_output_tokens=1, store=False, input=[
            {"role": "user", "content": "What is two and two?"}, {"role": "assistant", "content": whole.output_text},
            {"role": "user", "content": "Sure?"}])
        assert again.usage.input_tokens == plain.usage.input_tokens


def test_deepseek_r1_reasons_freely_before_a_grammar(tools_model_dir) -> None:
    """Under deepseek_r1 the template opened <think>: the reasoning is free, a grammar holds only the answer after
    </think> (engine/structured.py `after`; the tiny model never writes it, so its whole answer is reasoning)."""
    config = ServerConfig(model=str(tools_model_dir), served_model_name="r1", num_kv_blocks=256, max_model_len=1024,
                          engine_process=False, reasoning_parser="deepseek_r1", enable_auto_tool_choice=True,
                          tool_call_parser="hermes")
    with in_process(build_app(config), "r1-server") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        # the WebSocket chat: the reasoning's text as its deltas' `reasoning`, split as the OpenAI routes split it
        user = [{"role": "user", "content": "What is two and two?"}]
        r = client.chat.completions.create(model="r1", messages=user, max_tokens=12, temperature=0)
        frames = asyncio.run(_ws_chat(s, messages=user, max_tokens=12, temperature=0.0))
        reasoning = "".join(f.get("reasoning", "") for f in frames if f["type"] == "delta")
        text = "".join(f["text"] for f in frames if f["type"] == "delta")
        assert reasoning and (reasoning, text) == (r.choices[0].message.model_extra["reasoning_content"],
                                                   r.choices[0].message.content or "")
        assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 12  # (all of it)
        assert r.choices[0].message.content is None  # (no content at all: null, as vLLM's)
        r = client.chat.completions.create(model="r1", messages=user, max_tokens=12, temperature=0, tools=TOOLS)
        assert r.choices[0].message.content is None and not r.choices[0].message.tool_calls  # (so with auto tools)
        # held to JSON after its reasoning: the reasoning is the free answer's text (the grammar is not reached)
        frames = asyncio.run(_ws_chat(s, messages=user, max_tokens=12, temperature=0.0,
                                      response_format={"type": "json_object"}))
        assert "".join(f.get("reasoning", "") for f in frames if f["type"] == "delta") == reasoning
        m = client.chat.completions.create(model="r1", messages=user, max_tokens=12, temperature=0,
                                           response_format={"type": "json_object"}).choices[0].message
        assert (m.model_extra["reasoning_content"], m.content or "") == (reasoning, "")
        # a named call whose answer was cut off in its reasoning: no call (whole or streamed)
        kw = dict(model="r1", messages=user, tools=TOOLS, max_tokens=12, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] and (m.content, m.tool_calls, r.choices[0].finish_reason) == (
            None, None, "length")
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        # an answer continuing the last message: that message's text says where it starts (its grammar holds it all)
        cont = client.chat.completions.create(
            model="r1", messages=[*user, {"role": "assistant", "content": "<think>I add"}], max_tokens=40,
            extra_body={"continue_final_message": True, "add_generation_prompt": False,
                        "guided_regex": r" two and two\.</think>It is 4\."}).choices[0].message
        assert (cont.model_extra["reasoning_content"], cont.content) == (" two and two.", "It is 4.")


def _tokens_through(logprobs, text: str) -> int:
    """How many of the tokens (logprobs entries) it takes for their text to hold `text`."""
    seen = ""
    for i, t in enumerate(logprobs, start=1):
        seen += t.token
        if text in seen:
            return i
    raise AssertionError(f"{text!r} is not in {seen!r}")


async def _ws_chat(server, **chat) -> list[dict]:
    ws = await open_ws(server)
    try:
        await send(ws, type="chat", id="c", **chat)
        frames = (await collect(ws, {"c"}))["c"]
    finally:
        await ws.close()
    check_chat_frames(frames)
    return frames
