"""The official `openai` package, unmodified, against a real server; OpenAI error shapes and statuses;
client disconnects abort; `/metrics` parsed by prometheus_client matches the requests just made."""
from __future__ import annotations

import asyncio
import re
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.app import build_app
from service.config import ServerConfig
from tests.service.conftest import (
    LONG, MAIN_ENGINE, TOO_LONG, Server, finished_requests, in_process, open_ws, send, wait_engine_idle, wait_running,
)

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def client(main_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{main_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models(client: openai.OpenAI, model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].object == "model"
    assert client.models.retrieve(model) == models[0]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-nope")
    assert e.value.code == "model_not_found"


def test_chat_stream_equals_non_stream(client: openai.OpenAI, model: str) -> None:
    params = dict(model=model, messages=MESSAGES, max_tokens=24, temperature=0.0)
    full = client.chat.completions.create(**params)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the second identical prompt is served from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_chat_logprobs_and_max_completion_tokens(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=6, temperature=0.0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert r.usage.completion_tokens == 6 and len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-4  # greedy takes the best


SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # the tiny tokenizer's: in logprobs, never in text


def test_logprob_bytes_join_to_the_text(client: openai.OpenAI, model: str) -> None:
    """The tiny model's text at temperature 1.5 is random bytes: characters split over tokens. Each token's `bytes`
    are its own, so they join to the text's (OpenAI's promise), and its name writes split bytes as `\\xNN`, so
    different tokens are told apart; completions' `text_offset`s point into the text."""
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=300, temperature=1.5, seed=1,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    # (random bytes are not always UTF-8: the text writes what is not as U+FFFD, the bytes are the tokens')
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == text  # special tokens: no bytes
    assert any(e.token.startswith("\\x") for e in content), "no character split over tokens: pick another seed"
    for e in content:
        assert len({t.token for t in e.top_logprobs}) == 5
    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=200, temperature=1.5, seed=0,
                                  logprobs=5)
    lp, text = c.choices[0].logprobs, c.choices[0].text
    assert all(len(top) == 5 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for tok, offset in zip(lp.tokens, lp.text_offset):
        if "\\x" not in tok and tok not in SPECIALS:  # a whole token (not a special one) is where its offset says
            assert text[offset : offset + len(tok)] == tok, (tok, offset)


def test_null_means_the_default_and_vllm_extensions(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """OpenAI's nullable fields take null as leaving them out; vLLM's `stop_token_ids`, `min_tokens` and
    `include_stop_str_in_output` work; its other parameters that would change the output are refused, not ignored
    (the values that change nothing pass)."""
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        for route, body in (("/v1/chat/completions", {**chat, "n": None, "stream": None, "logprobs": None}),
                            ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "n": None,
                                                 "stream": None, "echo": None, "logprobs": None})):
            r = http.post(route, json=body)
            assert r.status_code == 200, r.text
        for name, value in (("use_beam_search", True), ("chat_template", "{{ x }}"), ("reasoning_effort", "high")):
            r = http.post("/v1/chat/completions", json={**chat, name: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
            assert r.json()["error"]["code"] == "unsupported_parameter"
        r = http.post("/v1/chat/completions", json={**chat, "min_tokens": 0, "use_beam_search": False,
                                                    "skip_special_tokens": True, "bad_words": [],
                                                    "reasoning_effort": "none"})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={**chat, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
        r = http.post("/v1/completions", json={"model": model, "prompt": [], "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    stop = dict(model=model, messages=MESSAGES, max_tokens=40, temperature=0.0, stop=["o"],
                extra_body={"ignore_eos": True})
    cut = client.chat.completions.create(**stop).choices[0]
    kept = client.chat.completions.create(**{**stop, "extra_body": {"ignore_eos": True,
                                                                    "include_stop_str_in_output": True}}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop" and kept.message.content == cut.message.content + "o"
    every = list(range(1024))  # every id of the tiny vocabulary
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True, "stop_token_ids": every})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    # min_tokens: the stop ids cannot come among the first; the one id left is drawn until then
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                       extra_body={"ignore_eos": True, "stop_token_ids": every[:-1], "min_tokens": 3})
    assert r.usage.completion_tokens > 3
    # logit_bias (OpenAI's own): +100 makes one token win every step, sampled or not
    names = [client.completions.create(model=model, prompt="hi", max_tokens=5, temperature=1.0, seed=1, logprobs=0,
                                       logit_bias={str(t): 100}, extra_body={"ignore_eos": True})
             .choices[0].logprobs.tokens for t in (700, 701)]
    assert [len(n) for n in names] == [5, 5] and len(set(names[0])) == len(set(names[1])) == 1 and names[0] != names[1]
    # allowed_token_ids (vLLM's): only those come, sampled or not
    one = client.completions.create(model=model, prompt="hi", max_tokens=5, temperature=1.0, seed=1, logprobs=0,
                                    extra_body={"ignore_eos": True, "allowed_token_ids": [700]}).choices[0].logprobs
    assert one.tokens == names[0]
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        for extra in ({"allowed_token_ids": []}, {"allowed_token_ids": [5, 1024]}):  # none; one not in the vocabulary
            r = http.post("/v1/chat/completions", json={**chat, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
        for extra in ({"min_tokens": 9}, {"min_tokens": 3, "stop_token_ids": every},  # more than max_tokens; nothing,
                      {"min_tokens": 3, "stop_token_ids": [5], "allowed_token_ids": [5]}):  # nothing allowed
            r = http.post("/v1/chat/completions", json={**chat, "max_tokens": 8, "ignore_eos": True, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_completions_stream_equals_non_stream(client: openai.OpenAI, model: str) -> None:
    params = dict(model=model, prompt="Once upon a time", max_tokens=20, temperature=0.0, seed=3)
    full = client.completions.create(**params)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**params, stream=True) if c.choices)
    assert streamed == full.choices[0].text and full.object == "text_completion"
    r = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=4, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


def _computed(server: Server) -> float:
    return sum(v for (name, _), v in _scrape(server).items() if name == "sluice_prompt_tokens_computed_total")


async def test_n_choices_share_the_prompt(main_server: Server, model: str) -> None:
    """The prompt of `n` choices is computed once: while a stream keeps the engine stepping, the four arrive
    together, and one step could compute all their prompts (the budget is 256 tokens), but the scheduler holds the
    others back until the first's blocks are in the prefix cache."""
    ws, observer = await open_ws(main_server), await open_ws(main_server)
    await send(ws, type="chat", id="busy", messages=MESSAGES, max_tokens=LONG, ignore_eos=True)
    await wait_running(observer)
    prompt = "Tell me about rivers, " * 12  # 180 tokens, in no other test: not cached yet
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "n": 4, "ignore_eos": True}
    computed = _computed(main_server)
    async with httpx.AsyncClient(base_url=main_server.url, timeout=120) as http:
        r = (await http.post("/v1/completions", json=body)).json()
    prompt_tokens = r["usage"]["prompt_tokens"]
    # the first computes it all; each other one only the partial block its last token is in
    assert _computed(main_server) - computed == prompt_tokens + 3 * ((prompt_tokens - 1) % 16 + 1), r["usage"]
    await send(ws, type="cancel", id="busy")
    await wait_engine_idle(observer)
    await ws.close()
    await observer.close()


def test_n_choices(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """`n` choices: a seeded request's choice i is what seed + i gives alone (vLLM's rule), the prompt counts once in
    usage, and a stream's chunks carry each choice's index and one finish each."""
    prompt = "Tell me about lakes, " * 12
    params = dict(model=model, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    r = client.completions.create(**params, n=3)
    prompt_tokens = r.usage.prompt_tokens
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    alone = [client.completions.create(**{**params, "seed": 7 + i}) for i in range(3)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.completion_tokens == 36 and r.usage.total_tokens == prompt_tokens + 36
    assert prompt_tokens == alone[0].usage.prompt_tokens
    chunks = list(client.completions.create(**params, n=3, stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["", "", ""], [[], [], []]
    for c in chunks[:-1]:
        (choice,) = c.choices  # one choice a chunk, as OpenAI streams them
        texts[choice.index] += choice.text
        finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    assert texts == [c.text for c in r.choices] and finishes == [["length"]] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 36
    assert len({c.id for c in chunks}) == 1

    chat = dict(model=model, messages=MESSAGES, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**chat, n=2)  # greedy: the same answer twice
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(**chat, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    for i in (0, 1):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) == \
            r.choices[i].message.content
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        for n in (0, 129, "2"):
            r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "n": n})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=TOO_LONG, n=2)
    assert e.value.code == "context_length_exceeded"


def test_a_batch_of_prompts(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """Completions take a list of prompts (strings or token id lists), each with its `n` choices: choice
    prompt * n + i is what that prompt and seed + i give alone, and usage adds up every prompt once."""
    prompts = ["Once upon a time", [5, 6, 7, 8, 9]]
    params = dict(model=model, max_tokens=6, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=prompts, n=2, **params)
    alone = [client.completions.create(prompt=p, **{**params, "seed": 3 + i}) for p in prompts for i in range(2)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert r.usage.completion_tokens == 24
    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                            **params))
    texts = ["", "", "", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in r.choices] and chunks[-1].usage == r.usage
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        for prompt, n in ((["ok", []], 1), (["ok", ["no"]], 1), (["ok"] * 9, 128)):  # empty; not ids; 1,152 choices
            r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "n": n, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        for stream in (False, True):  # a stream waits for every prompt's admission: any refusal is its status
            for bad, param in ((TOO_LONG, "prompt"), ([99_999_999], "prompt")):
                r = http.post("/v1/completions", json={"model": model, "prompt": ["ok", bad], "max_tokens": 1,
                                                       "stream": stream})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (stream, r.text)
            assert r.headers["content-type"] == "application/json"


def test_a_prefilled_answer(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """vLLM's `continue_final_message`: the answer continues the last (assistant's) message, as a completion of the
    templated text up to it would; `echo` starts the answer with that message's text; `add_generation_prompt`
    false ends the prompt after the last message's turn."""
    messages = [*MESSAGES, {"role": "assistant", "content": "The Nile,"}]
    opened = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName three rivers.<|im_end|>\n" \
             "<|im_start|>assistant\n"
    greedy = dict(model=model, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    expected = client.completions.create(prompt=opened + "The Nile,", **greedy).choices[0].text
    r = client.chat.completions.create(messages=messages, **{**greedy, "extra_body": {
        "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}})
    assert r.choices[0].message.content == expected
    r = client.chat.completions.create(messages=messages, **{**greedy, "extra_body": {
        "ignore_eos": True, "continue_final_message": True, "echo": True}})  # (add_generation_prompt then false)
    assert r.choices[0].message.content == "The Nile," + expected
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **{**greedy, "extra_body": {
        "ignore_eos": True, "continue_final_message": True, "echo": True}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The Nile," + expected
    closed = client.completions.create(prompt=opened.removesuffix("<|im_start|>assistant\n"), **greedy).choices[0]
    r = client.chat.completions.create(messages=MESSAGES, **{**greedy, "extra_body": {
        "ignore_eos": True, "add_generation_prompt": False, "echo": True}})  # (the last message is not the assistant's)
    assert r.choices[0].message.content == closed.text
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                    "continue_final_message": True, "add_generation_prompt": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_truncate_prompt_tokens(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """vLLM's `truncate_prompt_tokens`: only the prompt's last k tokens are the prompt, even from a prompt longer than
    the context; -1 keeps as many as leave room for a token."""
    ids = [(i * 7) % 1000 + 16 for i in range(5000)]  # over the 4,096-token context
    greedy = dict(model=model, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=ids, **{**greedy, "extra_body": {"ignore_eos": True,
                                                                         "truncate_prompt_tokens": 10}})
    assert r.usage.prompt_tokens == 10 and r.choices[0].text == client.completions.create(
        prompt=ids[-10:], **greedy).choices[0].text
    r = client.completions.create(prompt=ids, model=model, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == MAIN_ENGINE["max_model_len"] - 1 and r.usage.completion_tokens == 1
    r = client.chat.completions.create(messages=MESSAGES, **{**greedy, "extra_body": {"truncate_prompt_tokens": 5}})
    assert r.usage.prompt_tokens == 5
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        for k in (0, -2):
            r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "truncate_prompt_tokens": k})
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_structured_output(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """OpenAI's `response_format` (a JSON schema) and vLLM's `guided_choice`, `guided_regex` and `structured_outputs`
    hold the text to them, the tiny model's random weights notwithstanding; a bad one is a 400 naming its field."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}, n=2)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=0.0,
                                       extra_body={"guided_choice": ["Nile", "Amazon", "Danube"]})
    assert r.choices[0].message.content in ("Nile", "Amazon", "Danube") and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model, prompt="Call", max_tokens=30, seed=2, stream=True,
                                            extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}))
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", "".join(c.choices[0].text for c in chunks))
    # vLLM's guided_grammar (EBNF, GBNF's dialect) and OpenAI's structural tag (a JSON object between its tags)
    r = client.completions.create(model=model, prompt="Answer", max_tokens=30, seed=3, extra_body={
        "guided_grammar": 'root ::= ("yes" | "no") " " [0-9] [0-9]?'})
    assert re.fullmatch("(yes|no) [0-9][0-9]?", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=100, seed=4, response_format={
        "type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>", "content": {
            "type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}}})  # (the random model loops on it)
    text = r.choices[0].message.content
    assert text.startswith("<answer>") and text.endswith("</answer>") and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text[len("<answer>"):-len("</answer>")]), schema)
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        for extra, param in (({"response_format": {"type": "xml"}}, "response_format"),
                             ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
                              "response_format"),
                             ({"guided_json": "{nope"}, "guided_json"),
                             ({"guided_json": '{"items":' * 1500 + "{}" + "}" * 1500}, "guided_json"),  # too deep
                             ({"guided_regex": "[a-"}, "guided_regex"),  # (the engine's compiler refuses it)
                             ({"guided_choice": []}, "guided_choice"),
                             ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex"),  # two at once
                             ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
                             ({"structured_outputs": {"yaml": "a: 1"}}, "structured_outputs"),
                             ({"guided_grammar": "root ::= (("}, "guided_grammar"),
                             ({"structural_tag": '{"structures": []}'}, "structural_tag"),
                             ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "response_format")):
            r = http.post("/v1/chat/completions", json={**chat, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        r = http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}})
        assert r.status_code == 200, r.text


def test_return_tokens_as_token_ids(client: openai.OpenAI, model: str, tiny_model_dir) -> None:
    """vLLM's `return_tokens_as_token_ids`: logprobs name each token `token_id:N`, N the token's id; the rest (bytes,
    logprobs, offsets) as without it."""
    from engine.detokenizer import TokenText
    from engine.loader import load_tokenizer

    names = TokenText(load_tokenizer(tiny_model_dir))
    params = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.0, logprobs=3)
    plain = client.completions.create(**params).choices[0].logprobs
    ids = client.completions.create(**params, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert [names.name(int(t.removeprefix("token_id:"))) for t in ids.tokens] == plain.tokens
    assert ids.token_logprobs == plain.token_logprobs and ids.text_offset == plain.text_offset
    assert [sorted(v for v in top.values()) for top in ids.top_logprobs] == \
        [sorted(v for v in top.values()) for top in plain.top_logprobs]
    assert all(k.startswith("token_id:") for top in ids.top_logprobs for k in top)
    chat = dict(model=model, messages=MESSAGES, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**chat).choices[0].logprobs.content
    ids = client.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    for a, b in zip(plain, ids.logprobs.content):
        assert names.name(int(b.token.removeprefix("token_id:"))) == a.token and b.bytes == a.bytes
        assert [names.name(int(t.token.removeprefix("token_id:"))) for t in b.top_logprobs] == \
            [t.token for t in a.top_logprobs]


def test_bad_words(client: openai.OpenAI, model: str, tiny_model_dir) -> None:
    """vLLM's `bad_words`: the words of a greedy answer, banned, never come back as its tokens (alone or after a
    space), so the answer is another from its first token on."""
    from engine.processor import bad_words_ids
    from engine.loader import load_tokenizer

    greedy = dict(model=model, prompt="Once upon a time", max_tokens=40, temperature=0.0, logprobs=0)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}  # (the answer's token ids, in its logprobs)
    words = client.completions.create(**greedy, extra_body=extra).choices[0].text.split()[:3]
    r = client.completions.create(**greedy, extra_body={**extra, "bad_words": words}).choices[0]
    out = [int(t.removeprefix("token_id:")) for t in r.logprobs.tokens]
    assert len(out) == 40 and not r.text.startswith(words[0])
    for seq in bad_words_ids(load_tokenizer(tiny_model_dir), words, 1024):
        assert not any(out[i : i + len(seq)] == seq for i in range(len(out))), (seq, r.text)


def test_openai_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": TOO_LONG}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"  # as OpenAI names it
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=TOO_LONG)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=5)
    for create in (lambda n: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=n),
                   lambda n: client.completions.create(model=model, prompt="hi", max_tokens=n)):
        with pytest.raises(openai.BadRequestError) as e:  # as OpenAI and vLLM: refused, not silently capped
            create(MAIN_ENGINE["max_model_len"])
        assert e.value.code == "context_length_exceeded" and "max_tokens" in e.value.message
        assert e.value.param == "max_tokens"


def test_http_error_shapes(main_server: Server, model: str) -> None:
    with httpx.Client(base_url=main_server.url) as http:
        r = http.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = http.post("/v1/chat/completions", json={"model": model})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = http.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = http.post("/v1/completions", content=b"x" * 70_000)  # --max-message-bytes=65536
        assert r.status_code == 413


def _post(port: int, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def _abort_count(server: Server) -> float:
    return finished_requests(server).get("abort", 0.0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
async def test_disconnect_aborts(main_server: Server, model: str, stream: bool, n: int) -> None:
    """Hanging up while the request runs aborts it, each of its choices. The hang-up waits for every choice to
    run (the stream's first bytes, or `stats`), and each has nearly the whole context still to generate."""
    before = _abort_count(main_server)
    observer = await open_ws(main_server)
    body = httpx.Request("POST", "http://x", json={
        "model": model, "messages": MESSAGES, "max_tokens": LONG, "ignore_eos": True, "stream": stream, "n": n,
        "temperature": 1.0}).content
    s = await asyncio.to_thread(_post, main_server.port, body)
    with s:
        if stream:
            assert await asyncio.to_thread(s.recv, 1)  # headers come with every choice's first output
        else:
            await wait_running(observer, n)
    await wait_engine_idle(observer)
    await observer.close()
    assert _abort_count(main_server) == before + n


def _scrape(server: Server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_match_requests(main_server: Server, client: openai.OpenAI, model: str) -> None:
    before = _scrape(main_server)
    n, tokens = 3, 7
    for i in range(n):
        r = client.completions.create(model=model, prompt=f"count {i}", max_tokens=tokens,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == tokens
    after = _scrape(main_server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("sluice_requests_total", api="completions", finish_reason="length") == n
    assert delta("sluice_request_completion_tokens_total", api="completions") == n * tokens
    assert delta("sluice_generation_tokens_total") == n * tokens
    assert delta("sluice_e2e_request_latency_seconds_count") == n
    assert delta("sluice_time_to_first_token_seconds_count") == n
    assert delta("sluice_queue_time_seconds_count") == n
    # one gap per request per loop turn that brought it tokens: steps the loop takes together (a busy loop, a
    # loaded machine) are one gap, so at most tokens - 1 each (and a request whose tokens all came in one turn has none)
    assert 1 <= delta("sluice_inter_token_latency_seconds_count") <= n * (tokens - 1)
    assert delta("sluice_num_steps_total") >= tokens
    assert delta("sluice_prefix_cache_queries_total") > 0
    assert after[("sluice_num_running", ())] == 0.0
    assert after[("sluice_num_kv_blocks", ())] == MAIN_ENGINE["num_kv_blocks"]
    assert ("sluice_websocket_connections", ()) in after


def test_add_special_tokens_as_vllm(bos_model_dir) -> None:
    """A completion's text prompt gets the tokenizer's special tokens (a Llama's BOS), a chat only its template's,
    unless `add_special_tokens` says otherwise (vLLM's defaults and parameter)."""
    config = ServerConfig(model=str(bos_model_dir), num_kv_blocks=128, max_model_len=256, engine_process=False)
    with in_process(build_app(config), "bos-server") as server, httpx.Client(base_url=server.url, timeout=60) as http:
        def prompt_tokens(route: str, **body) -> int:
            r = http.post(route, json={"model": bos_model_dir.name, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        text = {"prompt": "hello world"}
        assert prompt_tokens("/v1/completions", **text) == prompt_tokens("/v1/completions", **text,
                                                                           add_special_tokens=False) + 1
        chat = {"messages": MESSAGES}
        assert prompt_tokens("/v1/chat/completions", **chat) + 1 == prompt_tokens("/v1/chat/completions", **chat,
                                                                                  add_special_tokens=True)


def test_echo_and_prompt_logprobs(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """Completions' `echo` starts the text with the prompt's, and with `logprobs` its tokens lead the answer's (the
    first's logprob and top null), as lm-evaluation-harness scores a continuation; vLLM's `prompt_logprobs` gives
    each prompt token's logprob, rank and top alternatives, per choice (completions) or per response (chat)."""
    prompt = "The river runs to the sea, and the sea"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0, echo=True)
    assert r.choices[0].text == prompt + plain.choices[0].text
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0, echo=True, logprobs=2,
                                  extra_body={"prompt_logprobs": 2})
    (c,) = r.choices
    lp, prompt_lps = c.logprobs, c.model_extra["prompt_logprobs"]
    n = r.usage.prompt_tokens
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(prompt_lps) == n and prompt_lps[0] is None
    assert "".join(lp.tokens[:n]) == prompt and lp.text_offset[n] == len(prompt) and c.text.startswith(prompt)
    for j in range(1, n):  # the echoed tokens' logprobs are the prompt's
        (tid, entry), *top = prompt_lps[j].items()
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[j]) and entry["decoded_token"] == lp.tokens[j]
        assert entry["rank"] >= 1 and len(lp.top_logprobs[j]) <= 2
        best = max(lp.top_logprobs[j].values())
        assert entry["logprob"] <= best + 1e-6 and (entry["rank"] == 1) == (entry["logprob"] >= best - 1e-6)
    # a prompt of token ids is echoed as its tokens' text; a stream's text and logprobs are the whole answer's
    ids = [t for t in range(40, 60)]
    whole = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0.0, echo=True, logprobs=1)
    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0.0, echo=True,
                                            logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == \
        whole.choices[0].logprobs.tokens
    assert len(whole.choices[0].logprobs.tokens) == len(ids) + whole.usage.completion_tokens
    # vLLM's max_tokens 0 with echo: the prompt alone, scored (no token of the answer's, streamed or not)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    (c,) = r.choices
    assert c.text == prompt and c.finish_reason == "length" and c.logprobs.tokens == lp.tokens[:n]
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (0, n)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-2].choices[0].finish_reason == "length"
    # chat: the response's, over the templated prompt
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0})
    plps = r.model_extra["prompt_logprobs"]
    assert len(plps) == r.usage.prompt_tokens and plps[0] is None and all(len(e) == 1 for e in plps[1:])
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "stream": True,
                                                    "prompt_logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_tokenize_and_detokenize(main_server: Server, client: openai.OpenAI, model: str) -> None:
    """vLLM's /tokenize gives the ids a completion's prompt or a chat's messages make (their count is the usage's
    prompt_tokens) and the context; /detokenize gives their text back."""
    with httpx.Client(base_url=main_server.url, timeout=60) as http:
        r = http.post("/tokenize", json={"model": model, "prompt": "The river runs", "return_token_strs": True})
        assert r.status_code == 200, r.text
        t = r.json()
        completion = client.completions.create(model=model, prompt="The river runs", max_tokens=1)
        assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) == completion.usage.prompt_tokens
        assert t["max_model_len"] == 4096
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["count"] == client.chat.completions.create(model=model, messages=MESSAGES,
                                                               max_tokens=1).usage.prompt_tokens
        assert chat["token_strs"] is None
        open_turn = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
        assert open_turn["tokens"] == chat["tokens"][:open_turn["count"]] and open_turn["count"] < chat["count"]
        r = http.post("/detokenize", json={"model": model, "tokens": t["tokens"]})
        assert r.status_code == 200 and r.json() == {"prompt": "The river runs"}, r.text
        for route, body, status, param in (
                ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
                ("/tokenize", {}, 400, "prompt"),
                ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
                ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
                ("/tokenize", {"prompt": "x", "chat_template": "{{ 1 }}"}, 400, "chat_template"),
                ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
                ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
                ("/detokenize", {"tokens": [1] * 4097}, 400, "tokens")):  # (more than the context holds)
            r = http.post(route, json=body)
            assert r.status_code == status and r.json()["error"]["param"] == param, (route, body, r.text)


def test_a_streamed_batch_waits_for_every_prompts_verdict(tiny_model_dir, monkeypatch) -> None:
    """A streamed batch of prompts whose second is refused by the engine (token ids outside the vocabulary) after the
    first has started (its tokenizing held until then: the order that used to start the stream): a 400, as unstreamed,
    not a 200 whose stream ends in an error event."""
    import threading

    from service.bridge import EngineBridge

    bad = [99_999_999]
    first_started = threading.Event()
    start, tokenize = EngineBridge._start, EngineBridge._tokenize

    def _start(self, handle, *args):
        start(self, handle, *args)
        first_started.set()

    def _tokenize(self, req):
        if req.prompt == bad:
            assert first_started.wait(60)
        return tokenize(self, req)

    monkeypatch.setattr(EngineBridge, "_start", _start)
    monkeypatch.setattr(EngineBridge, "_tokenize", _tokenize)
    config = ServerConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_model_len=256, engine_process=False)
    with in_process(build_app(config), "batch-server") as server, httpx.Client(base_url=server.url, timeout=60) as http:
        for n in (1, 2):
            first_started.clear()
            r = http.post("/v1/completions", json={"model": tiny_model_dir.name, "prompt": ["ok", bad], "n": n,
                                                   "max_tokens": 4, "stream": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_bug_is_a_500_in_openais_shape(tiny_model_dir, monkeypatch) -> None:
    """An exception no route expected (a bug) answers 500 as an OpenAI error under /v1, which SDKs parse, not
    Starlette's plain text."""
    from starlette.testclient import TestClient

    from service import openai_api

    async def broken(request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_api, "models", broken)
    app = build_app(ServerConfig(model=str(tiny_model_dir), engine_process=False))
    r = TestClient(app, raise_server_exceptions=False).get("/v1/models")  # (no lifespan: no engine starts)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "a bug" not in r.text  # (the traceback goes to the log, not to the client)


def test_before_the_engine_is_ready_the_api_says_retry(tiny_model_dir) -> None:
    """While the engine starts the model's name is not known: /v1/models and a request naming the model answer 503
    (retryable), not a model with no name or a 404 that clients do not retry."""
    from starlette.testclient import TestClient

    app = build_app(ServerConfig(model=str(tiny_model_dir), engine_process=False))
    http = TestClient(app, raise_server_exceptions=False)  # (no lifespan: no engine starts)
    for r in (http.get("/v1/models"), http.get("/v1/models/tiny"),
              http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
              http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}),
              http.post("/tokenize", json={"model": "tiny", "prompt": "x"})):
        assert r.status_code == 503 and "retry" in r.json()["error"]["message"], (r.request.url, r.text)


def test_content_parts_are_text_joined_by_newlines(client: openai.OpenAI, model: str) -> None:
    """A message's content may be a list of text parts (text, input_text, output_text, and an assistant's refusal,
    replayed): joined by newlines, as vLLM joins them; another part is a 400 naming it."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a river."},
                                          {"type": "input_text", "text": "Only one."}]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
             {"role": "user", "content": "Please?"}]
    plain = [{"role": "user", "content": "Name a river.\nOnly one."}, {"role": "assistant", "content": "I cannot."},
             {"role": "user", "content": "Please?"}]
    params = dict(model=model, max_tokens=8, temperature=0.0)
    a = client.chat.completions.create(messages=parts, **params)
    b = client.chat.completions.create(messages=plain, **params)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}],
            **params)
    assert e.value.param == "messages[0].content[1].type" and e.value.code == "unsupported_parameter"


def test_continuous_usage_stats(client: openai.OpenAI, model: str) -> None:
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): each chunk carries its choice's usage so
    far; the last, choiceless chunk the whole response's, as without it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in ((client.chat.completions.create, {"messages": MESSAGES}), (client.completions.create,
                                                                                   {"prompt": "Rivers"})):
        chunks = list(create(model=model, max_tokens=6, temperature=0.0, stream=True, stream_options=options,
                             extra_body={"ignore_eos": True}, **kw))
        *running, last = chunks
        assert running and all(c.usage is not None for c in running)
        counts = [c.usage.completion_tokens for c in running]
        assert counts == sorted(counts) and counts[-1] == last.usage.completion_tokens == 6
        assert all(c.usage.prompt_tokens == last.usage.prompt_tokens and
                   c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in running)
        # without include_usage it asks for nothing (vLLM's rule)
        plain = list(create(model=model, max_tokens=2, temperature=0.0, stream=True,
                            stream_options={"continuous_usage_stats": True}, **kw))
        assert all(c.usage is None for c in plain)
