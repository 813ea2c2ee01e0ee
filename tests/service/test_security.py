"""A guarded server: API key (HTTP 401 / WebSocket 1008), allowed Origins, connection cap,
admission queue (`overloaded` / HTTP 429) and a pinned system prompt; and, in process, a model fault
that fails only its request."""
from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from engine import EngineConfig, LLMEngine
from service.app import build_app
from service.config import ServerConfig
from tests.server import wait_websockets
from tests.service.conftest import (LONG, MAIN_ENGINE, Server, check_chat_frames, collect, in_process, recv, send,
                                    start_server, user_chat)

KEY = "s3cret-key"
ORIGIN = "http://chat.example"
FAULT = "__explode_here__"
MAX_CONNECTIONS, MAX_QUEUED = 4, 2
AUTH = {"Authorization": f"Bearer {KEY}"}
PINNED = "You are the pinned assistant. Be brief, be kind, and always answer in plain words." * 2


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("guarded")
    (tmp / "system.txt").write_text(PINNED)
    server = start_server(
        tmp, f"--pin-system-prompt={tmp / 'system.txt'}", "--num-kv-blocks=512", f"--max-model-len={MAIN_ENGINE['max_model_len']}", "--max-num-seqs=1",
        f"--max-connections={MAX_CONNECTIONS}", f"--max-connections-per-client={MAX_CONNECTIONS}",  # (one address)
        f"--max-queued-requests={MAX_QUEUED}",
        f"--max-queued-requests-per-client={MAX_QUEUED}",  # (the queue is this one client's: test_overloaded_queue)
        f"--allowed-origins=http://other.example,{ORIGIN}", env={"SLUICE_API_KEY": KEY})
    yield server
    assert server.stop() == 0, server.log_text()[-4000:]


def faulty_engine(config: EngineConfig) -> LLMEngine:
    """A real engine whose model fails every step that holds a prompt containing FAULT."""
    eng = LLMEngine(config)
    run = eng.runner.run

    def run_or_fail(batch, samples):
        if any(FAULT in eng.tokenizer.decode(r.token_ids[: r.num_prompt_tokens]) for r in batch.reqs):
            raise RuntimeError("injected fault")
        return run(batch, samples)

    eng.runner.run = run_or_fail
    return eng


@pytest.fixture(scope="module")
def faulty(tiny_model_dir) -> Iterator[SimpleNamespace]:
    """The app `sluice serve` builds, over `faulty_engine`, under uvicorn in a thread of this process."""
    config = ServerConfig(model=str(tiny_model_dir), api_key=KEY, num_kv_blocks=512,
                          max_model_len=MAIN_ENGINE["max_model_len"], max_num_seqs=1,
                          engine_process=False)  # an engine thread: the factory is a closure
    app = build_app(config, engine_factory=lambda: faulty_engine(EngineConfig(**config.engine_kwargs())))
    with in_process(app, "faulty-server") as server:
        yield server


async def authed(server: Server | SimpleNamespace, **kwargs) -> object:
    ws = await connect(server.ws_url, additional_headers=AUTH, **kwargs)
    assert (await recv(ws))["type"] == "ready"
    return ws


def test_http_needs_the_key(guarded: Server) -> None:
    r = httpx.get(f"{guarded.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{guarded.url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # open for load balancers
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}), ("/v1/responses",
                                                                                             {"input": "hi"})):
        assert httpx.post(f"{guarded.url}{route}", json=body).status_code == 401  # (they run the tokenizer)
        assert httpx.post(f"{guarded.url}{route}", json=body, headers=AUTH).status_code != 401, route
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200  # and scrapers

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("first", [user_chat("c", "hi"), {"type": "hello", "api_key": "wrong"}, None])
async def test_websocket_without_the_key_closes_1008(guarded: Server, first: dict | None) -> None:
    headers = {"Authorization": "Bearer wrong"} if first is None else {}
    ws = await connect(guarded.ws_url, additional_headers=headers)
    if first is not None:
        await ws.send(json.dumps(first))
    err = await recv(ws)
    assert err["type"] == "error" and err["code"] == "unauthorized" and err["id"] is None
    with pytest.raises(ConnectionClosed) as info:
        await recv(ws)
    assert info.value.rcvd.code == 1008


async def test_websocket_with_hello_or_header(guarded: Server) -> None:
    ws = await connect(guarded.ws_url)
    await send(ws, type="hello", api_key=KEY)
    assert (await recv(ws))["type"] == "ready"
    await ws.send(json.dumps(user_chat("a", "hi", max_tokens=3)))
    check_chat_frames((await collect(ws, {"a"}))["a"])
    await ws.close()
    ws = await authed(guarded)
    await send(ws, type="ping", data=1)
    assert await recv(ws) == {"type": "pong", "data": 1}
    await ws.close()


async def test_origin_allowlist(guarded: Server) -> None:
    with pytest.raises(InvalidStatus) as info:
        await connect(guarded.ws_url, origin="http://evil.example", additional_headers=AUTH)
    assert info.value.response.status_code == 403
    ws = await authed(guarded, origin=ORIGIN)
    await ws.close()


async def test_max_connections(guarded: Server) -> None:
    await wait_websockets(guarded, 0)  # sockets closed by earlier tests finish their close handshake
    sockets = [await authed(guarded) for _ in range(MAX_CONNECTIONS)]
    with pytest.raises(InvalidStatus) as info:
        await connect(guarded.ws_url, additional_headers=AUTH)
    assert info.value.response.status_code == 503
    for ws in sockets:
        await ws.close()


async def test_overloaded_queue(guarded: Server) -> None:
    ws = await authed(guarded)
    await ws.send(json.dumps(user_chat("run", "hello", max_tokens=LONG, ignore_eos=True)))
    assert (await recv(ws))["type"] == "start"  # runs now (--max-num-seqs=1): the queue is empty
    waiting = [f"w{k}" for k in range(MAX_QUEUED)]
    for i in [*waiting, "refused"]:
        await ws.send(json.dumps(user_chat(i, "hello", max_tokens=4)))
    err = await recv(ws)
    while err.get("id") == "run":  # skip the running chat's deltas
        err = await recv(ws)
    assert err["type"] == "error" and err["code"] == "overloaded" and err["id"] == "refused", err
    async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH) as http:
        r = await http.post("/v1/completions", json={"model": "sluice-tiny-v1", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
    await send(ws, type="cancel", id="run")
    frames = await collect(ws, {"run", *waiting})
    assert frames["run"][-1]["type"] == "done" and frames["run"][-1]["finish_reason"] == "cancelled"
    for i in waiting:  # queued, not refused: they run once there is room
        check_chat_frames(frames[i])
    await ws.close()


async def test_step_fault_fails_only_its_request(faulty: SimpleNamespace) -> None:
    ws = await authed(faulty)
    await ws.send(json.dumps(user_chat("boom", f"please {FAULT} now", max_tokens=8)))
    err = (await collect(ws, {"boom"}))["boom"][-1]
    assert err["type"] == "error" and err["code"] == "internal" and err["id"] == "boom"
    await ws.send(json.dumps(user_chat("fine", "and now a normal question", max_tokens=8, ignore_eos=True)))
    text, done = check_chat_frames((await collect(ws, {"fine"}))["fine"])
    assert done["usage"]["completion_tokens"] == 8 and text
    await ws.close()
    r = httpx.get(f"{faulty.url}/health")
    assert r.status_code == 200


async def test_pinned_system_prompt_is_cached_from_the_first_chat(guarded: Server) -> None:
    ws = await authed(guarded)
    await send(ws, type="chat", id="p", max_tokens=2,
               messages=[{"role": "system", "content": PINNED}, {"role": "user", "content": "first!"}])
    frames = (await collect(ws, {"p"}))["p"]
    start = frames[0]
    assert start["type"] == "start" and start["cached_tokens"] >= 16, start  # at least one full KV block
    await send(ws, type="stats")
    stats = await recv(ws)
    assert stats["num_running"] == 0 and stats["num_free_kv_blocks"] < stats["num_kv_blocks"]  # pinned stay
    await ws.close()


def test_a_key_that_is_not_ascii_matches_in_the_header_as_in_hello() -> None:
    """A header's bytes come decoded as Latin-1: the Bearer token is read back as UTF-8, so `--api-key clé` matches
    the header a client sends (its UTF-8 bytes), as it matches `hello` (JSON, text)."""
    from starlette.datastructures import Headers

    from service.auth import bearer_token, key_matches

    key = "clé-ü"
    sent = Headers(raw=[(b"authorization", b"Bearer " + key.encode())])
    assert key_matches(bearer_token(sent), key)
    assert key_matches(bearer_token(Headers(raw=[(b"authorization", b"Bearer cl\xe9-\xfc")])), key)  # (Latin-1 too)
    assert not key_matches(bearer_token(Headers(raw=[(b"authorization", b"Bearer cle-u")])), key)
    assert bearer_token(Headers(raw=[(b"authorization", b"Bearer plain")])) == "plain"
    assert bearer_token(Headers(raw=[(b"authorization", b"Basic x")])) is None
