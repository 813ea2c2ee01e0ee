"""`--reasoning-parser` (service/openai_reasoning.py): a reasoning model's `<think>` text apart from its content, cut
anywhere when streamed; through a real server (the tiny model, a regex writing a reasoning answer for it), chat
completions' `reasoning_content` and the Responses API's reasoning item, whole and streamed alike, with tools."""
from __future__ import annotations

import json

import openai
import pytest

from service.app import build_app
from service.config import ServerConfig
from service.openai_reasoning import ThinkStream, split
from tests.service.conftest import in_process
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
    assert split(parser, text) == (reasoning, content)
    for size in (1, 2, 5):
        stream = ThinkStream(parser)
        parts = [p for i in range(0, len(text), size) for p in stream.feed(text[i:i + size])] + stream.end()
        assert "".join(t for k, t in parts if k == "reasoning") == (reasoning or "")
        assert "".join(t for k, t in parts if k == "content") == content


def test_reasoning_is_apart_in_chat_and_responses(tools_model_dir) -> None:
    config = ServerConfig(model=str(tools_model_dir), served_model_name="r1", num_kv_blocks=256, max_model_len=1024,
                          engine_process=False, reasoning_parser="deepseek_r1", enable_auto_tool_choice=True,
                          tool_call_parser="hermes")
    regex = r"I add (two|three) and two\.</think>It is (4|5)\."
    with in_process(build_app(config), "reasoning-server") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="r1", messages=MESSAGES, max_tokens=100, logprobs=True, temperature=0,
                  extra_body={"guided_regex": regex})
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        reasoning = m.model_extra["reasoning_content"]
        assert reasoning.startswith("I add") and reasoning.endswith("two.") and m.content.startswith("It is")
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
        streamed = {"reasoning_content": "", "content": ""}
        n_logprobs = 0
        for chunk in client.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed["content"] += delta.content or ""
            n_logprobs += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert streamed == {"reasoning_content": reasoning, "content": m.content} and n_logprobs == len(
            r.choices[0].logprobs.content)
        # the tools parse the content, not the reasoning
        call = r'I should call it\.</think><tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
        r = client.chat.completions.create(model="r1", messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                           extra_body={"guided_regex": call})
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "I should call it." and m.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_time",
                                                                                                 {"zone": "UTC"})]
        # the Responses API: a reasoning item, then the message; streamed the same
        kw = dict(model="r1", input="What is two and two?", max_output_tokens=100, temperature=0,
                  extra_body={"guided_regex": regex})
        whole = client.responses.create(**kw)
        with client.responses.stream(**kw) as stream:
            types = [e.type for e in stream]
            final = stream.get_final_response()
        for resp in (whole, final):
            assert [i.type for i in resp.output] == ["reasoning", "message"]
            assert resp.output[0].content[0].text.endswith("two.") and resp.output_text.startswith("It is")
        assert final.output[0].content[0].text == whole.output[0].content[0].text
        assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
        # its reasoning given back as an input item is left out of the next prompt
        again = client.responses.create(model="r1", max_output_tokens=1, store=False, input=[
            {"role": "user", "content": "What is two and two?"}, whole.output[0].model_dump(exclude_none=True),
            {"role": "assistant", "content": whole.output_text}, {"role": "user", "content": "Sure?"}])
        plain = client.responses.create(model="r1", max_output_tokens=1, store=False, input=[
            {"role": "user", "content": "What is two and two?"}, {"role": "assistant", "content": whole.output_text},
            {"role": "user", "content": "Sure?"}])
        assert again.usage.input_tokens == plain.usage.input_tokens
