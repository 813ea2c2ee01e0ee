"""WebSocket protocol against a real server: many concurrent chats equal to the engine alone,
incremental streaming, cancel/close freeing the KV cache, and every per-frame error code."""
from __future__ import annotations

import asyncio
import json

import pytest
from websockets.exceptions import ConnectionClosed

from tests.service.conftest import (
    LONG, MAIN_ENGINE, TOO_LONG, Server, check_chat_frames, collect, open_ws, recv, send, user_chat,
    wait_engine_idle,
)

SYSTEM = ("You are Sluice, a terse assistant. Answer in one short sentence, cite nothing, "
          "and never repeat the question back to the user.")
N_CONN, PER_CONN, MAX_TOKENS = 50, 2, 12


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]


@pytest.fixture(scope="module")
def reference_texts(tiny_model_dir) -> list[tuple[str, int]]:
    """(text, completion tokens) of each greedy chat, from the engine alone with the server's config."""
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server (OMP_NUM_THREADS=1), so float reductions match
    try:
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), **MAIN_ENGINE))
        prompts = [eng.apply_chat_template(_messages(i)) for i in range(N_CONN * PER_CONN)]
        outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    finally:
        torch.set_num_threads(threads)
    return [(o.text, len(o.token_ids)) for o in outs]


async def test_many_connections_share_system_prompt_and_match_engine(main_server: Server, reference_texts) -> None:
    async def one_connection(c: int) -> dict[str, list[dict]]:
        ws = await open_ws(main_server)
        try:
            ids = {f"c{c}-{k}" for k in range(PER_CONN)}
            for k in range(PER_CONN):
                i = c * PER_CONN + k
                await send(ws, type="chat", id=f"c{c}-{k}", messages=_messages(i), max_tokens=MAX_TOKENS,
                           temperature=0.0)
            return await collect(ws, ids, timeout=240)
        finally:
            await ws.close()

    results = await asyncio.gather(*(one_connection(c) for c in range(N_CONN)))
    uncached = 0
    for c, frames in enumerate(results):
        for k in range(PER_CONN):
            text, done = check_chat_frames(frames[f"c{c}-{k}"])
            ref_text, ref_tokens = reference_texts[c * PER_CONN + k]
            assert text == ref_text, f"chat c{c}-{k} differs from the engine alone"
            assert done["usage"]["completion_tokens"] == ref_tokens
            start = frames[f"c{c}-{k}"][0]
            assert start["cached_tokens"] == done["usage"]["cached_tokens"]
            uncached += start["cached_tokens"] == 0
    assert uncached <= 10, f"{uncached} of {N_CONN * PER_CONN} chats missed the shared system prompt"


async def test_streaming_is_incremental(main_server: Server) -> None:
    ws = await open_ws(main_server)
    await ws.send(json.dumps(user_chat("inc", "Tell me a long story.", max_tokens=LONG, ignore_eos=True,
                                       temperature=0.0)))
    frames = [await recv(ws)]
    while len([f for f in frames if f["type"] == "delta"]) < 4:  # deltas arrive while the answer is generated
        frames.append(await recv(ws))
        assert frames[-1]["type"] in ("start", "delta"), frames[-1]
    await send(ws, type="cancel", id="inc")
    frames += (await collect(ws, {"inc"}))["inc"]
    text, done = check_chat_frames(frames)
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < LONG
    assert done["timing"]["ttft_ms"] <= done["timing"]["total_ms"]
    await ws.close()


async def test_cancel_mid_stream_frees_everything(main_server: Server) -> None:
    ws = await open_ws(main_server)
    await ws.send(json.dumps(user_chat("long", "Go on forever.", max_tokens=LONG, ignore_eos=True)))
    assert (await recv(ws))["type"] == "start"
    assert (await recv(ws))["type"] == "delta"
    await send(ws, type="cancel", id="long")
    rest = (await collect(ws, {"long"}))["long"]
    assert [f["type"] for f in rest][-1] == "done" and set(f["type"] for f in rest[:-1]) <= {"delta"}
    assert rest[-1]["finish_reason"] == "cancelled"
    assert rest[-1]["usage"]["completion_tokens"] < LONG
    await wait_engine_idle(ws)
    await send(ws, type="cancel", id="long")  # finished now: unknown, and nothing else changes
    err = await recv(ws)
    assert err["type"] == "error" and err["code"] == "unknown_id" and err["id"] is None
    await ws.close()


async def test_closing_socket_aborts_its_chats(main_server: Server) -> None:
    ws = await open_ws(main_server)
    for k in range(3):
        await ws.send(json.dumps(user_chat(f"x{k}", "Keep talking.", max_tokens=LONG, ignore_eos=True)))
    while (await recv(ws))["type"] != "delta":
        pass
    await ws.close()
    observer = await open_ws(main_server)
    stats = await wait_engine_idle(observer)
    assert stats["requests_in_flight"] == 0
    await observer.close()


async def test_every_frame_error_code_keeps_the_connection(main_server: Server) -> None:
    ws = await open_ws(main_server)

    async def expect_error(code: str, chat_id: str | None = None) -> dict:
        msg = await recv(ws)
        while msg["type"] in ("start", "delta"):  # the running chats' output, in any order with the errors
            msg = await recv(ws)
        assert msg["type"] == "error" and msg["code"] == code and msg["id"] == chat_id, msg
        assert msg["message"]
        return msg

    await ws.send("{not json")
    await expect_error("invalid_json")
    await ws.send(b'{"type": "ping"}')
    await expect_error("invalid_message")
    await send(ws, type="teleport")
    await expect_error("invalid_message")
    await send(ws, type="chat", id="t", messages=[{"role": "user", "content": "hi"}], temperature=-1)
    msg = await expect_error("invalid_message", "t")
    assert "temperature" in msg["message"]
    await send(ws, type="chat", id="t", messages=[{"role": "user", "content": "hi"}], max_tokens=3, min_tokens=4)
    msg = await expect_error("invalid_message", "t")
    assert "min_tokens" in msg["message"] and msg.get("param", "min_tokens") == "min_tokens"
    await send(ws, type="chat", id="t", messages=[{"role": "user", "content": "hi"}], response_format={"type": "xml"})
    assert "response_format" in (await expect_error("invalid_message", "t"))["message"]
    await send(ws, type="chat", id="", messages=[{"role": "user", "content": "hi"}])
    await expect_error("invalid_message")
    await send(ws, type="chat", id="t", messages=[])
    await expect_error("invalid_message", "t")
    await send(ws, type="chat", id="t", messages=[{"role": "user", "content": "hi"}], max_tokens=3, tempreature=1)
    assert "tempreature" in (await expect_error("invalid_message", "t"))["message"]
    await send(ws, type="cancel", id="nobody")
    await expect_error("unknown_id")

    await ws.send(json.dumps(user_chat("big", TOO_LONG)))
    assert str(MAIN_ENGINE["max_model_len"]) in (await expect_error("prompt_too_long", "big"))["message"]

    for k in range(4):  # --max-inflight-per-connection=4
        await ws.send(json.dumps(user_chat(f"f{k}", "hello", max_tokens=LONG, ignore_eos=True)))
    await ws.send(json.dumps(user_chat("f0", "again")))
    await expect_error("duplicate_id")
    await ws.send(json.dumps(user_chat("f4", "one too many")))
    await expect_error("too_many_inflight", "f4")
    for k in range(4):
        await send(ws, type="cancel", id=f"f{k}")
    frames = await collect(ws, {f"f{k}" for k in range(4)})
    assert all(f[-1]["type"] == "done" and f[-1]["finish_reason"] == "cancelled" for f in frames.values())

    await send(ws, type="ping", data={"still": ["here", 1]})
    assert await recv(ws) == {"type": "pong", "data": {"still": ["here", 1]}}
    await ws.send(json.dumps(user_chat("after", "hi", max_tokens=3, temperature=0.0)))
    check_chat_frames((await collect(ws, {"after"}))["after"])
    await ws.close()


async def test_a_chat_held_to_a_json_schema(main_server: Server) -> None:
    """`response_format` (OpenAI's shape) on a WebSocket chat: its text is JSON of the schema, then it ends."""
    schema = {"type": "object", "properties": {"river": {"enum": ["Nile", "Amazon"]}, "long": {"type": "boolean"}},
              "required": ["river", "long"], "additionalProperties": False}
    ws = await open_ws(main_server)
    await send(ws, type="chat", id="j", messages=[{"role": "user", "content": "A river?"}], max_tokens=200, seed=3,
               response_format={"type": "json_schema", "json_schema": {"name": "river", "schema": schema}})
    frames = (await collect(ws, {"j"}))["j"]
    assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "stop", frames[-1]
    answer = json.loads("".join(f["text"] for f in frames if f["type"] == "delta"))
    assert answer["river"] in ("Nile", "Amazon") and isinstance(answer["long"], bool) and len(answer) == 2
    await ws.close()


async def test_oversized_frame_closes_1009(main_server: Server) -> None:
    ws = await open_ws(main_server)
    await ws.send(json.dumps(user_chat("huge", "x" * 70_000)))  # --max-message-bytes=65536
    with pytest.raises(ConnectionClosed) as info:
        await recv(ws)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009


def test_no_prompt_or_completion_text_in_the_log(main_server: Server, reference_texts) -> None:
    log = main_server.log_text()
    assert "Question 7: what is 7 + 7?" not in log and SYSTEM[:40] not in log
    assert not [text for text, _ in reference_texts if len(text) >= 20 and text in log]
