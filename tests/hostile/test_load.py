"""Hostile load against a real `sluice serve`: a storm of clients that hang up at random moments over
WebSocket, SSE and plain HTTP, and floods of many-message prompts beside a streaming neighbour.

Seeded and bounded; every request asks for nearly the whole context, so none can end by itself while its
client is still there, and "it finished" can only mean "it was aborted".
"""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from bench.flooder import FRAME
from service.protocol import decode_client
from tests.server import REPO, Server, start_server
from tests.service.conftest import finished_requests, recv, user_chat, wait_engine_idle

MAX_MODEL_LEN = 4096
LONG = MAX_MODEL_LEN - 128
STORM_CLIENTS, STORM_CONCURRENCY = 1200, 48


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("hostile-load"), f"--max-model-len={MAX_MODEL_LEN}",
                     "--num-kv-blocks=2048", "--max-num-batched-tokens=256", "--max-queued-requests=4096")
    yield s
    assert s.stop() == 0, s.log_tail(60)
    assert "Traceback" not in s.log_text(), s.log_tail(80)


def _http_request(model: str, stream: bool, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"storm {rng.random()}"}]}
    else:
        path, body = "/v1/completions", {"prompt": f"storm {rng.random()}"}
    data = json.dumps({"model": model, "max_tokens": LONG, "ignore_eos": True, "stream": stream, **body}).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


async def _ws_client(server: Server, rng: random.Random) -> None:
    async with connect(server.ws_url, max_size=None) as ws:
        assert (await recv(ws))["type"] == "ready"
        for k in range(rng.randint(1, 3)):
            await ws.send(json.dumps(user_chat(f"s{k}", f"storm {rng.random()}", max_tokens=LONG, ignore_eos=True)))
        for _ in range(rng.choice([0, 0, 1, 2, 5])):  # hang up after this many frames: at any stage of a chat
            await recv(ws)
        if rng.random() < 0.5:
            ws.transport.abort()  # no close frame: a dropped network


async def _http_client(server: Server, model: str, stream: bool, rng: random.Random) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        request = _http_request(model, stream, rng)
        if rng.random() < 0.15:  # gone mid-body
            writer.write(request[: rng.randrange(len(request) - 1)])
            await writer.drain()
            return
        writer.write(request)
        await writer.drain()
        if stream:
            for _ in range(rng.choice([0, 1, 3])):  # hang up after this many lines of the stream
                await reader.readline()
        else:
            await asyncio.sleep(rng.choice([0, 0, 0.005, 0.02]))
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()
        else:
            writer.close()


async def test_disconnect_storm_leaves_nothing_running(server: Server) -> None:
    """1,200 clients over WebSocket, SSE and HTTP each hang up at a random moment: afterwards nothing runs or
    waits, every KV block is free, and no request ran on to its end for a client that was gone."""
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    before = finished_requests(server)
    rng = random.Random(13)
    seeds = [rng.random() for _ in range(STORM_CLIENTS)]
    gate = asyncio.Semaphore(STORM_CONCURRENCY)

    async def one(i: int) -> None:
        r = random.Random(seeds[i])
        async with gate:
            kind = r.choice(["ws", "sse", "http"])
            try:
                if kind == "ws":
                    await _ws_client(server, r)
                else:
                    await _http_client(server, model, kind == "sse", r)
            except (OSError, ConnectionError):
                pass  # the server may see the hang-up first; either way the client is gone

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(STORM_CLIENTS))), 600)

    async with connect(server.ws_url) as observer:
        assert (await recv(observer))["type"] == "ready"
        stats = await wait_engine_idle(observer, timeout=120)
    assert stats["requests_in_flight"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    after = finished_requests(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert delta.get("length", 0) == delta.get("stop", 0) == 0, f"generations outlived their clients: {delta}"
    assert delta.get("abort", 0) > STORM_CLIENTS // 2, delta  # most reached the engine before their client left


async def _neighbour_gaps(server: Server, tokens: int) -> list[float]:
    """Gaps between the deltas of one greedy stream of `tokens` tokens."""
    async with connect(server.ws_url) as ws:
        assert (await recv(ws))["type"] == "ready"
        await ws.send(json.dumps(user_chat("n", "neighbour", max_tokens=tokens, ignore_eos=True, temperature=0.0)))
        stamps = []
        while True:
            msg = await recv(ws)
            if msg["type"] == "delta":
                stamps.append(time.perf_counter())
            elif msg["type"] in ("done", "error"):
                assert msg["type"] == "done", msg
                break
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def test_many_message_flood_does_not_stall_a_neighbour(server: Server) -> None:
    """A neighbour's worst gap between tokens while another client floods 1 MB frames of 28,000 one-character
    messages stays within a few times its worst gap alone, plus the parse of a few frames. Before, each frame was
    templated on the engine thread (~0.7 s each, every stream frozen meanwhile); now it is refused on the loop by a
    bound on its tokens, and a connection that keeps the loop busy is read more slowly (service/budget.py)."""
    tokens = 600
    alone = max(await _neighbour_gaps(server, tokens))
    flooder = subprocess.Popen(  # (from another address: another client)
        ["nice", "-n", "19", sys.executable, "-m", "bench.flooder", server.ws_url, "127.0.0.2"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # the flood is under way: three frames refused
            assert await asyncio.to_thread(flooder.stdout.readline) == "prompt_too_long\n"
        flooded = await _neighbour_gaps(server, tokens)
    finally:
        flooder.kill()
        flooder.wait()
    alone = max(alone, max(await _neighbour_gaps(server, tokens)))
    # NOTE: the loop must still parse each frame it reads (the budget only reads a flooder less often), so a
    # neighbour may wait for one frame's parse; what the fix removed is a templating pass per frame on the engine
    # thread (~0.7 s, ~50 parses). Both sides of the bound scale with this CPU: the parse is timed here.
    started = time.perf_counter()
    decode_client(FRAME)
    parse = time.perf_counter() - started
    print(f"neighbour worst gap: {max(flooded) * 1e3:.1f} ms flooded, {alone * 1e3:.1f} ms alone; "
          f"one frame parses in {parse * 1e3:.1f} ms")
    # (loose: worst gaps are outliers on a shared 2-core VM; the stall this guards against was ~50 parses, and the
    # ratio itself is `python -m bench flood`'s target)
    assert max(flooded) <= 5 * alone + 10 * parse, (
        f"worst gap {max(flooded) * 1e3:.1f} ms vs {alone * 1e3:.1f} ms alone (a frame parses in {parse * 1e3:.1f} ms)")


async def test_costly_prompts_on_one_socket_do_not_hold_back_another_clients_chat(server: Server) -> None:
    """Sixteen prompts just under the early length bound in flight on one socket, each templated and tokenized
    (a large share of a second apiece here) before the engine refuses it: another client's chat, sent while they
    are being tokenized, is tokenized after at most one more of them (the tokenizer takes its clients in turn), not
    after every one left (it took them in arrival order: seconds of queue for everyone else)."""
    big = "hello " * (250_000 // 6)  # characters / 16 stays under four contexts (4 x 4096 tokens): not refused early
    flood_errors: list[float] = []
    # (another client: another address; connections from one address are one client)
    async with connect(server.ws_url, max_size=None) as flood, \
            connect(server.ws_url, max_size=None, local_addr=("127.0.0.2", 0)) as other:
        assert (await recv(flood))["type"] == "ready" and (await recv(other))["type"] == "ready"
        for i in range(16):
            await flood.send(json.dumps(user_chat(f"f{i}", big)))
        await flood.send(json.dumps({"type": "ping"}))  # its pong: the server has read (and queued) all sixteen
        while (m := await recv(flood))["type"] != "pong":
            assert m["type"] == "error" and m["code"] == "prompt_too_long", m
            flood_errors.append(time.monotonic())
        left = 16 - len(flood_errors)
        assert left >= 4, "the flood was tokenized before the other chat was sent: nothing to compare"
        await other.send(json.dumps(user_chat("o", "hi", max_tokens=1)))

        async def rest_of_flood() -> None:
            while len(flood_errors) < 16:
                m = await recv(flood)
                assert m["type"] == "error" and m["code"] == "prompt_too_long", m
                flood_errors.append(time.monotonic())

        reader = asyncio.create_task(rest_of_flood())
        assert (await recv(other))["type"] == "start"
        started = time.monotonic()
        await reader
    before = sum(t < started for t in flood_errors) - (16 - left)
    assert before <= 2, f"{before} of the {left} costly prompts left were tokenized before the other client's chat"


async def _wait_stats(ws, running: int, waiting: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        await ws.send(json.dumps({"type": "stats"}))
        stats = await recv(ws)
        if (stats["num_running"], stats["num_waiting"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, f"not {running} running and {waiting} waiting: {stats}"
        await asyncio.sleep(0.02)


async def test_a_client_that_fills_every_seat_leaves_one_for_another(tiny_model_dir, tmp_path) -> None:
    """Four seats (`--max-num-seqs=4`) and a queue of 16: one address's twelve chats of nearly the whole context
    take every seat and queue the rest, its half of the queue (a thirteenth, from another connection of the same
    address, the same client, is refused as overloaded). A chat from another address is admitted, takes a seat
    from it at the next step and is done while every one of the twelve still runs or waits; /metrics counts the
    seat taken. A batch of more choices than a client's share is a 400, not a 429 to retry for ever. Before, the other chat waited for one of the twelve to end (~4,000 tokens)."""
    server = start_server(tmp_path, f"--max-model-len={MAX_MODEL_LEN}", "--max-num-seqs=4",
                          "--max-queued-requests=16")
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        async with connect(server.ws_url) as hog, connect(server.ws_url) as same_address:
            assert (await recv(hog))["type"] == "ready" and (await recv(same_address))["type"] == "ready"
            for i in range(12):  # (8, then 4 more once 4 run: 8 at once is all one client may queue)
                await hog.send(json.dumps(user_chat(f"h{i}", f"hog {i}", max_tokens=LONG, ignore_eos=True)))
                if i == 7:
                    await _wait_stats(same_address, running=4, waiting=4)
            await _wait_stats(same_address, running=4, waiting=8)
            await same_address.send(json.dumps(user_chat("more", "one more", max_tokens=2)))
            refused = await recv(same_address)
            assert (refused["type"], refused["code"]) == ("error", "overloaded"), refused
            assert "--max-queued-requests-per-client" in refused["message"], refused

            before = finished_requests(server)
            async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                         transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")) as other:
                r = await other.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 2, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "my turn"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
            after = finished_requests(server)
            ended = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
            assert ended == {"length": 1}, f"requests ended before the other client's: {ended} (its own is one)"
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={  # (more than the client's share: never)
            "model": model, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "--max-queued-requests-per-client" in r.json()["error"]["message"], r.text
        fair = sum(s.value for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
                   for s in f.samples if s.name == "sluice_fair_preemptions_total")
        assert fair >= 1
    finally:
        assert server.stop() == 0, server.log_tail(60)


async def test_the_addresses_of_an_internet_ipv6_64_are_one_client(tiny_model_dir, tmp_path) -> None:
    """One seat and a queue of 4, so a client may queue 2. Chats from four addresses of one IPv6 /64 (named by
    X-Forwarded-For, which the server trusts from 127.0.0.1 as from a proxy there) are one client's: the first runs,
    two wait, the fourth is refused as overloaded; a chat from another /64 is queued. Before, every address was a
    client of its own (a host has 2^64 of them), and the fourth was queued."""
    server = start_server(tmp_path, f"--max-model-len={MAX_MODEL_LEN}", "--max-num-seqs=1",
                          "--max-queued-requests=4")

    def at(address: str):
        return connect(server.ws_url, additional_headers={"X-Forwarded-For": address})

    try:
        async with (at("2a00:1450:4001:81b::1") as a1, at("2a00:1450:4001:81b::2") as a2,
                    at("2a00:1450:4001:81b:5::3") as a3, at("2a00:1450:4001:81b:ffff::4") as a4,
                    at("2a00:1450:4001:81c::1") as b):
            for ws in (a1, a2, a3, a4, b):
                assert (await recv(ws))["type"] == "ready"
            for i, ws in enumerate((a1, a2, a3)):
                await ws.send(json.dumps(user_chat(f"a{i}", f"mine {i}", max_tokens=LONG, ignore_eos=True)))
                await _wait_stats(b, running=1, waiting=i)
            await a4.send(json.dumps(user_chat("a3", "one more", max_tokens=LONG, ignore_eos=True)))
            refused = await recv(a4)
            assert (refused["type"], refused["code"]) == ("error", "overloaded"), refused
            assert "--max-queued-requests-per-client" in refused["message"], refused
            await b.send(json.dumps(user_chat("b", "another site", max_tokens=LONG, ignore_eos=True)))
            await _wait_stats(b, running=1, waiting=3)
    finally:
        assert server.stop() == 0, server.log_tail(60)
