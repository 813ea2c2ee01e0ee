"""Pure protocol parsing (service/protocol.py): no server, no engine."""
from __future__ import annotations

import json

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from service.protocol import (
    ERROR_DETAIL_CHARS, Cancel, Chat, Done, Error, Hello, Ping, Pong, Ready, StatsRequest, Timing, Usage, decode_client,
    encode,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def test_each_client_message_decodes() -> None:
    chat = decode_client(json.dumps({
        "type": "chat", "id": "c1", "messages": [{"role": "system", "content": "Be terse."},
                                                 {"role": "user", "content": "Hello"}],
        "max_tokens": 256, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 42, "stop": ["\n\n"], "ignore_eos": False,
        "min_tokens": 2}))
    assert isinstance(chat, Chat) and chat.id == "c1" and chat.max_tokens == 256
    assert chat.message_dicts()[1] == {"role": "user", "content": "Hello"}
    assert chat.sampling_kwargs()["stop"] == ["\n\n"] and "max_tokens" not in chat.sampling_kwargs()
    off = decode_client('{"type": "chat", "id": "x", "messages": [{"role": "user", "content": ""}], "top_k": -1}')
    assert isinstance(off, Chat) and off.top_k == -1  # (vLLM's "off", as 0; SamplingParams makes it 0)
    assert isinstance(decode_client('{"type": "chat", "id": "x", "messages": [{"role": "user", "content": ""}], '
                                    '"top_k": -2}'), Error)
    minimal = decode_client('{"type": "chat", "id": "x", "messages": [{"role": "user", "content": ""}]}')
    assert isinstance(minimal, Chat) and minimal.sampling_kwargs() == {} and minimal.max_tokens is None
    assert decode_client('{"type": "cancel", "id": "c1"}') == Cancel(id="c1")
    assert decode_client('{"type": "stats"}') == StatsRequest()
    assert decode_client('{"type": "hello", "api_key": "k"}') == Hello(api_key="k")
    ping = decode_client('{"type": "ping", "data": {"n": [1, 2.5, "x"]}}')
    assert isinstance(ping, Ping)
    assert json.loads(encode(Pong(data=ping.data))) == {"type": "pong", "data": {"n": [1, 2.5, "x"]}}
    assert json.loads(encode(Pong(data=decode_client('{"type": "ping"}').data)))["data"] is None


def test_bad_frames_become_errors_that_say_what_is_wrong() -> None:
    cases = {
        "{": ("invalid_json", None, "JSON"),
        "[1, 2]": ("invalid_message", None, "object"),
        '{"type": "teleport"}': ("invalid_message", None, "teleport"),
        '{"id": "a"}': ("invalid_message", None, "type"),
        '{"type": "chat", "id": "a", "messages": []}': ("invalid_message", "a", "length >= 1"),
        '{"type": "chat", "id": "", "messages": [{"role": "user", "content": "x"}]}': ("invalid_message", None, "$.id"),
        '{"type": "chat", "id": "a", "messages": [{"role": "bot", "content": "x"}]}': ("invalid_message", "a", "role"),
        '{"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x"}], "top_p": 0}':
            ("invalid_message", "a", "top_p"),
        '{"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x"}], "min_tokens": -1}':
            ("invalid_message", "a", "min_tokens"),
        '{"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}':
            ("invalid_message", "a", "max_tokens"),
        '{"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x"}], "stop": [""]}':
            ("invalid_message", "a", "stop"),
        '{"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x"}], "temprature": 1}':
            ("invalid_message", "a", "temprature"),
        '{"type": "cancel"}': ("invalid_message", None, "id"),
        '{"type": "chat", "id": "' + "x" * 65 + '", "messages": []}': ("invalid_message", None, "length <= 64"),
    }
    for frame, (code, chat_id, mentions) in cases.items():
        err = decode_client(frame)
        assert isinstance(err, Error), frame
        assert (err.code, err.id) == (code, chat_id), (frame, err)
        assert mentions in err.message, (frame, err.message)


@given(json_values)
def test_any_json_is_a_message_or_an_invalid_message(value: object) -> None:
    result = decode_client(json.dumps(value))
    assert not isinstance(result, Error) or result.code == "invalid_message"


@given(st.binary(max_size=64) | st.text(max_size=64))
def test_no_frame_raises(frame: bytes | str) -> None:
    result = decode_client(frame)
    assert isinstance(result, Error) or isinstance(result, (Chat, Cancel, Ping, StatsRequest, Hello))


@given(st.text(min_size=1, max_size=64), st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1),
       st.integers(1, 10_000), st.floats(0.0, 2.0))
def test_valid_chats_round_trip(chat_id: str, roles: list[str], max_tokens: int, temperature: float) -> None:
    frame = {"type": "chat", "id": chat_id, "messages": [{"role": r, "content": r * 3} for r in roles],
             "max_tokens": max_tokens, "temperature": temperature}
    chat = decode_client(json.dumps(frame))
    assert isinstance(chat, Chat)
    assert (chat.id, chat.max_tokens, chat.temperature) == (chat_id, max_tokens, temperature)
    assert [m["role"] for m in chat.message_dicts()] == roles


def test_server_messages_encode_as_in_protocol() -> None:
    assert json.loads(encode(Ready(model="m", max_model_len=512, max_inflight=4))) == {
        "type": "ready", "protocol": 1, "model": "m", "max_model_len": 512, "max_inflight": 4, "defaults": {}}
    assert json.loads(encode(Ready(model="m", max_model_len=512, max_inflight=4, defaults={"temperature": 0.6})))[
        "defaults"] == {"temperature": 0.6}
    done = Done(id="c1", finish_reason="cancelled", usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
                timing=Timing(queue_ms=1.0, ttft_ms=2.0, total_ms=3.0))
    assert json.loads(encode(done)) == {
        "type": "done", "id": "c1", "finish_reason": "cancelled",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1},
        "timing": {"queue_ms": 1.0, "ttft_ms": 2.0, "total_ms": 3.0}}
    assert json.loads(encode(Error(code="unknown_id", message="no such chat"))) == {
        "type": "error", "id": None, "code": "unknown_id", "message": "no such chat"}
    assert isinstance(encode(done), str)  # text frames
    assert msgspec.json.decode(encode(done).encode())["type"] == "done"


def test_structured_output_fields() -> None:
    """Each structured-output field to its kind; vLLM's older structural tag (structures and triggers) to xgrammar's
    triggered tags; a wrong shape refused naming its field."""
    import pytest

    from engine import InvalidSamplingParam
    from service.protocol import structured_output

    assert structured_output(guided_grammar="root ::= \"a\"").kind == "grammar"
    assert structured_output(structured_outputs={"grammar": "start: \"a\""}).param == "structured_outputs.grammar"
    legacy = {"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f="]}
    for given in (legacy, json.dumps(legacy)):
        so = structured_output(structural_tag=given)
        assert (so.kind, so.param) == ("structural_tag", "structural_tag")
        assert json.loads(so.spec) == {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<f="], "tags": [{"type": "tag", "begin": "<f=a>", "end": "</f>",
                                                                      "content": {"type": "json_schema",
                                                                                  "json_schema": {"type": "object"}}}]}}
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert json.loads(structured_output(response_format=tag).spec) == tag
    for field, value in (("structural_tag", {"structures": [], "triggers": ["<"]}), ("structural_tag", "{nope"),
                         ("guided_grammar", " "), ("response_format", {"type": "yaml"})):
        with pytest.raises(InvalidSamplingParam) as e:
            structured_output(**{field: value})
        assert e.value.param == field


def test_an_error_quotes_at_most_a_little_of_the_frame() -> None:
    """A megabyte field name or tag value is not echoed back: errors are queued for clients that may read nothing."""
    for frame in ('{"type": "ping", "%s": 1}' % ("x" * 1_000_000), '{"type": "%s"}' % ("y" * 1_000_000)):
        err = decode_client(frame)
        assert isinstance(err, Error) and err.code in ("invalid_message", "invalid_json"), err
        assert len(err.message) < 2 * ERROR_DETAIL_CHARS and "more characters" in err.message, err.message[:300]
