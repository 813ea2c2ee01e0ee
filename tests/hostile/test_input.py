"""Hostile input: JSON nested 1,000 deep, unpaired surrogates, numbers out of range, wrong HTTP methods,
parameters Sluice does not implement, a full queue, a shutdown that cancels. Each is answered with a typed
error the client can act on; the connection and the server carry on, and no traceback is logged.

The wire tests run against real `sluice serve` processes; service/json_guard.py and `decode_client` are
also tested alone, including against msgspec itself.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from service import json_guard
from service.app import build_app
from service.config import ServerConfig
from service.json_guard import MAX_DEPTH
from service.protocol import Chat, Error, Ping, decode_client
from tests.service.conftest import (
    LONG, MAIN_FLAGS, Server, collect, open_ws, recv, send, start_server, user_chat, wait_engine_idle,
)

DEEP = 1_000  # levels: where msgspec's recursion gave out (RecursionError) before the depth check


def _nest(levels: int, inner: str = "0") -> str:
    return "[" * levels + inner + "]" * levels


# Every WebSocket input path, each a frame of about 2 KB nested DEEP levels.
DEEP_FRAMES = {
    "chat stop": '{"type": "chat", "id": "deep", "messages": [{"role": "user", "content": "x"}], "stop": '
                 + _nest(DEEP, '"x"') + "}",
    "chat messages": '{"type": "chat", "id": "deep", "messages": ' + _nest(DEEP, '{"role": "user", "content": "x"}')
                     + "}",
    "ping data": '{"type": "ping", "data": ' + _nest(DEEP) + "}",
    "unknown type": '{"type": "teleport", "to": ' + _nest(DEEP) + "}",
    "objects": '{"a": ' * DEEP + "0" + "}" * DEEP,
    "never closed": "[" * 2 * DEEP,
}


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


# ---- service/json_guard.py and decode_client, alone --------------------------------------------------------
@pytest.mark.parametrize("name", DEEP_FRAMES)
def test_deep_frame_is_an_invalid_json_error(name: str) -> None:
    for frame in (DEEP_FRAMES[name], DEEP_FRAMES[name].encode()):
        err = decode_client(frame)  # raised RecursionError before the depth check
        assert isinstance(err, Error) and (err.code, err.id) == ("invalid_json", None), err
        assert f"nested deeper than {MAX_DEPTH} levels" in err.message


def test_depth_limit_is_exact_and_ignores_brackets_in_strings() -> None:
    ping = '{"type": "ping", "data": %s}'  # the frame's own object is one level
    assert isinstance(decode_client(ping % _nest(MAX_DEPTH - 1)), Ping)
    assert decode_client(ping % _nest(MAX_DEPTH)).code == "invalid_json"
    brackets = json.dumps("[{" * 500 + '\\"[' * 100)  # in a string, escaped quotes and backslashes included
    assert isinstance(decode_client(ping % brackets), Ping)
    chat = decode_client(json.dumps(user_chat("code", "x = [[[[" * 200 + "]]]]" * 200)))
    assert isinstance(chat, Chat)


json_leaves = (st.none() | st.booleans() | st.integers()
               | st.text(alphabet='[]{}"\\ ax\u00e9\U0001f600', max_size=8))
json_values = st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(alphabet='[{"\\k', max_size=3), inner, max_size=3), max_leaves=10)


@given(json_values, st.integers(0, MAX_DEPTH + 8), st.booleans())
def test_depth_check_matches_the_real_depth(value: Any, wrap: int, ascii_only: bool) -> None:
    for i in range(wrap):
        value = [value] if i % 2 else {'k"[': value}
    doc = json.dumps(value, ensure_ascii=ascii_only)
    fits = _depth(value) <= MAX_DEPTH
    assert (json_guard.depth_error(doc) is None) == fits
    assert (json_guard.depth_error(doc.encode()) is None) == fits


# characters whose JSON escapes are surrogates, paired or not (json.dumps writes "\ud83d\ude00" for U+1F600)
SURROGATE_ALPHABET = ["a", "\\", '"', "\u00e9", "\U0001f600", "\ud83d", "\ude00", "\ud800", "\udfff"]


@given(st.lists(st.sampled_from(SURROGATE_ALPHABET), max_size=10).map("".join))
def test_unpaired_surrogate_is_named_exactly_when_msgspec_refuses(text: str) -> None:
    doc = json.dumps({"content": text})
    try:
        msgspec.json.decode(doc)
        refused = False
    except msgspec.DecodeError:
        refused = True
    error = json_guard.surrogate_error(doc)
    assert (error is not None) == refused, (doc, error)
    assert error is None or "unpaired UTF-16 surrogate" in error
    msgspec.json.decode(json_guard.without_unpaired_surrogates(doc))  # readable with U+FFFD in their place


def test_refused_chat_frames_carry_their_id() -> None:
    """A chat refused for a value (an unpaired surrogate, a number out of range) names its id (§6 rule)."""
    surrogate = decode_client('{"type": "chat", "id": "s", "messages": [{"role": "user", "content": "\\ud800b"}]}')
    assert isinstance(surrogate, Error) and (surrogate.code, surrogate.id) == ("invalid_message", "s")
    assert "unpaired UTF-16 surrogate (\\ud800" in surrogate.message  # was "Input data was truncated"
    for field in ("temperature", "max_tokens", "seed"):
        err = decode_client('{"type": "chat", "id": "n", "messages": [{"role": "user", "content": "x"}], '
                            f'"{field}": 1e999}}')
        assert isinstance(err, Error) and (err.code, err.id) == ("invalid_message", "n"), err  # was id None
        assert field in err.message
    for bad in ('\\ud800', 'ab\\udc00'):  # an id holding one is not well-formed: no id, not one it never sent
        err = decode_client('{"type": "chat", "id": "' + bad + '", "messages": [{"role": "user", "content": "x"}]}')
        assert isinstance(err, Error) and (err.code, err.id) == ("invalid_message", None), err
    paired = decode_client('{"type": "chat", "id": "p", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert isinstance(paired, Chat) and paired.messages[0].content == "\U0001f600"


def test_503_while_loading_says_when_to_retry() -> None:
    release = threading.Event()

    def factory() -> object:  # never loads
        release.wait(10)
        raise RuntimeError("not this time")

    with TestClient(build_app(ServerConfig(served_model_name="m", engine_process=False), engine_factory=factory)) as client:
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "5", (r.status_code, r.headers)
        release.set()


# ---- the WebSocket, against the shared server ------------------------------------------------------------
async def test_deep_frames_leave_the_connection_working(main_server: Server) -> None:
    mark = len(main_server.log_text())
    ws = await open_ws(main_server)
    try:
        for name, frame in DEEP_FRAMES.items():
            await ws.send(frame)
            err = await recv(ws)  # before the fix: no reply, the socket dropped (1006)
            assert (err["type"], err["code"], err["id"]) == ("error", "invalid_json", None), (name, err)
        data = _nest(MAX_DEPTH - 1)  # the most a ping can carry, echoed byte for byte
        await ws.send('{"type": "ping", "data": ' + data + "}")
        assert await asyncio.wait_for(ws.recv(), 60) == '{"type":"pong","data":' + data + "}"
        await send(ws, **user_chat("after", "still there?", max_tokens=2))
        assert (await collect(ws, {"after"}))["after"][-1]["type"] == "done"
    finally:
        await ws.close()
    assert "Traceback" not in main_server.log_text()[mark:]


async def test_refused_chats_carry_their_id_on_the_wire(main_server: Server) -> None:
    ws = await open_ws(main_server)
    try:
        await ws.send('{"type": "chat", "id": "hot", "messages": [{"role": "user", "content": "x"}], '
                      '"temperature": 1e999}')
        await ws.send('{"type": "chat", "id": "half", "messages": [{"role": "user", "content": "\\udfffb"}]}')
        errors = await collect(ws, {"hot", "half"})
        assert [(f["type"], f["code"]) for fs in errors.values() for f in fs] == [("error", "invalid_message")] * 2
        assert "unpaired UTF-16 surrogate" in errors["half"][0]["message"]
        # an id in flight is never named by a second terminal frame: the refusal is frame-level (§5)
        await send(ws, **user_chat("busy", "go on", max_tokens=LONG, ignore_eos=True))
        assert (await recv(ws))["type"] == "start"
        await ws.send('{"type": "chat", "id": "busy", "messages": [{"role": "user", "content": "x"}], '
                      '"temperature": 1e999}')
        msg = await recv(ws)
        while msg["type"] == "delta":
            msg = await recv(ws)
        assert (msg["type"], msg["id"]) == ("error", None) and "busy" in msg["message"], msg
        await send(ws, type="cancel", id="busy")
        frames = (await collect(ws, {"busy"}))["busy"]
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled"
        await wait_engine_idle(ws)
    finally:
        await ws.close()


# ---- HTTP, against the shared server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(main_server: Server) -> str:
    return httpx.get(f"{main_server.url}/v1/models").json()["data"][0]["id"]


def _chat_body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}


def test_deep_bodies_get_a_400_and_the_server_carries_on(main_server: Server, model: str) -> None:
    mark = len(main_server.log_text())
    chat = json.dumps(_chat_body(model))[:-1]
    deep = {
        "/v1/chat/completions": [chat + ', "metadata": ' + _nest(DEEP) + "}",  # a field the server ignores
                                 chat + ', "tools": ' + _nest(DEEP) + "}"],
        "/v1/completions": [json.dumps({"model": model, "max_tokens": 1})[:-1] + ', "prompt": ' + _nest(DEEP) + "}",
                            '{"model": ' + _nest(DEEP)],
    }
    with httpx.Client(base_url=main_server.url, timeout=120) as http:
        for path, bodies in deep.items():
            for body in bodies:
                r = http.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, r.status_code, r.text[:200])  # was 500 text/plain
                error = r.json()["error"]
                assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
                assert f"nested deeper than {MAX_DEPTH} levels" in error["message"]
        assert http.post("/v1/chat/completions", json=_chat_body(model)).status_code == 200
    assert "Traceback" not in main_server.log_text()[mark:]


def test_unpaired_surrogate_is_a_400_that_says_so(main_server: Server, model: str) -> None:
    body = json.dumps(_chat_body(model)).replace('"hi"', '"\\ud800b"')
    r = httpx.post(f"{main_server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_message", r.text
    assert "unpaired UTF-16 surrogate" in r.json()["error"]["message"]  # was "Input data was truncated"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
def test_wrong_method_is_a_405_with_allow(main_server: Server, method: str) -> None:
    with httpx.Client(base_url=main_server.url) as http:
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = http.request(method, path)  # GET was a 404 (the UI's static files), PUT a 405 `server_error`
            assert r.status_code == 405 and r.headers["allow"] == "POST", (path, r.status_code, r.headers)
            assert r.json()["error"]["type"] == "invalid_request_error"
        if method != "GET":
            r = http.request(method, "/v1/models")
            assert r.status_code == 405 and "GET" in r.headers["allow"].split(", ")


def test_unknown_v1_paths_are_404_in_openai_shape(main_server: Server) -> None:
    with httpx.Client(base_url=main_server.url) as http:
        for method, path in [("GET", "/v1/"), ("GET", "/v1/nothing-here"), ("POST", "/v1/chat/completions/x"),
                             ("GET", "/v1/ws")]:
            r = http.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (method, path, r.text)


_BAD = [  # (path, body with the model filled in, the 400's code, its param)
    ("/v1/chat/completions", b"{nope", "invalid_json", None),
    ("/v1/chat/completions", {"temperature": "hot"}, "invalid_message", "temperature"),
    ("/v1/chat/completions", {"temperature": 5}, "invalid_message", "temperature"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "invalid_message", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "invalid_message", "messages[0].role"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "invalid_message", "top_logprobs"),
    ("/v1/chat/completions", {"n": 0}, "invalid_message", "n"),
    # tools leave the choice to the model by default, which needs a tool-call parser this server was not given
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "invalid_message",
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "invalid_message", "tool_choice"),  # no tools
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f g"}}], "tool_choice": "required"},
     "invalid_message", "tools[0].function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "invalid_message",
     "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "invalid_message", "response_format"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= x"}, "invalid_message", "guided_grammar"),  # (x: no rule)
    ("/v1/chat/completions", {"logit_bias": {"50256": -100}}, "invalid_message", "logit_bias"),  # not in the vocabulary
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "invalid_message", "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "invalid_message", "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"-5": 1}}, "invalid_message", "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 1, "05": -1}}, "invalid_message", "logit_bias"),  # token 5 twice
    ("/v1/chat/completions", {"guided_json": [1]}, "invalid_message", "guided_json"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "invalid_message",
     "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "invalid_message",
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "unsupported_parameter", "messages[0].content[0].type"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "invalid_message", "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "unsupported_parameter", "best_of"),
    ("/v1/completions", {"prompt": [[1], []]}, "invalid_message", "prompt"),  # a batch with an empty prompt
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "high"}}, "invalid_message", "logit_bias"),
]


@pytest.mark.parametrize("path, body, code, param", _BAD, ids=[f"{p}-{c}-{q}" for p, _, c, q in _BAD])
def test_every_400_carries_a_code(main_server: Server, model: str, path: str, body: Any, code: str,
                                  param: str | None) -> None:
    if isinstance(body, dict):
        body = _chat_body(model, **body) if path.endswith("chat/completions") else {"model": model, **body}
    r = httpx.post(f"{main_server.url}{path}", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), error


def test_parameters_at_their_neutral_values_are_accepted(main_server: Server, model: str) -> None:
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
               "functions": None, "modalities": ["text"], "user": "u1", "store": False}
    r = httpx.post(f"{main_server.url}/v1/chat/completions", json=_chat_body(model, **neutral), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


# ---- a full queue, then a shutdown that cancels: a server of their own -----------------------------------
async def _wait_waiting(server: Server, n: int = 1, timeout: float = 60.0) -> None:
    """Poll `stats` until at least n requests wait for the engine."""
    ws = await open_ws(server)
    try:
        deadline = time.monotonic() + timeout
        while True:
            await send(ws, type="stats")
            stats = await recv(ws)
            if stats["num_waiting"] >= n:
                return
            assert time.monotonic() < deadline, f"nothing waiting: {stats}"
            await asyncio.sleep(0.02)
    finally:
        await ws.close()


async def test_full_queue_says_when_to_retry_and_a_shutdown_cancel_is_an_error(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    """One request runs (`--max-num-seqs=1`), one waits (the queue of 1 is full): a third gets 429 with
    Retry-After. SIGTERM with no grace cancels both: the stream ends with an `error` event, the waiting one
    gets 503 with Retry-After; neither reports a finish_reason (it was "abort", not an OpenAI value)."""
    server = start_server(tmp_path, *MAIN_FLAGS, "--max-num-seqs=1", "--max-queued-requests=1",
                          "--timeout-graceful-shutdown=0")
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        long = {"max_tokens": LONG, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async with http.stream("POST", "/v1/chat/completions",
                                   json=_chat_body(model, stream=True, **long)) as stream:
                assert stream.status_code == 200  # headers come once the engine runs it
                waiting = asyncio.create_task(
                    http.post("/v1/completions", json={"model": model, "prompt": "x", **long}))
                await _wait_waiting(server)
                r = await http.post("/v1/chat/completions", json=_chat_body(model))
                assert r.status_code == 429 and r.headers.get("retry-after") == "1", (r.status_code, r.headers)
                assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("server_overloaded", "overloaded")

                server.proc.send_signal(signal.SIGTERM)
                events = [line.removeprefix("data: ") async for line in stream.aiter_lines() if line]
            r = await waiting
        assert r.status_code == 503 and r.headers.get("retry-after") == "5", (r.status_code, r.text)
        assert "cancelled" in r.json()["error"]["message"]
        assert events[-1] == "[DONE]", events[-3:]
        *chunks, error = [json.loads(e) for e in events[:-1]]
        assert error["error"]["type"] == "service_unavailable", error
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks if c["choices"]), chunks[-1]
        assert await asyncio.to_thread(server.proc.wait, 60) == 0
        assert "Traceback" not in server.log_text(), server.log_tail(60)
    finally:
        server.stop()
