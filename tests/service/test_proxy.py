"""Replicas behind HAProxy, with the configuration `deploy/haproxy.py` generates (README "Scaling"): Debian's
haproxy and three real `sluice serve` processes. Streams pass through over WebSocket and SSE; a conversation's
second turn lands on the replica that has its prefix cached; a reload under load drops no stream; a killed
replica's streams end cleanly while new chats go on elsewhere. Each replica serves under its own model name, so a
response says which one answered."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.server import REPO, Server, free_port, spawn_server, wait_healthy
from tests.service.conftest import recv, send, user_chat

HAPROXY = shutil.which("haproxy") or ""


@pytest.fixture(scope="module", autouse=True)
def _needs_haproxy() -> None:  # module scope and autouse: before `cluster` starts anything
    if not HAPROXY:
        reason = "needs Debian's haproxy (.ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
        pytest.skip(reason)

REPLICAS = 3
FLAGS = ["--num-kv-blocks=1024", "--max-model-len=1024", "--max-inflight-per-connection=16"]
LONG = 900  # tokens: a stream that runs for hundreds of steps by construction


def render(*args: str) -> str:
    return subprocess.run([sys.executable, str(REPO / "deploy" / "haproxy.py"), *args], capture_output=True,
                          text=True, check=True).stdout


def haproxy_check(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True, check=False)


class Proxy:
    def __init__(self, tmp: Path, replicas: list[Server], *flags: str, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.cfg = tmp / "haproxy.cfg"
        self.cfg.write_text(render("--bind", f"{host}:{self.port}", "--check-interval", "300ms",
                                   *[f"--replica=127.0.0.1:{s.port}" for s in replicas], *flags))
        check = haproxy_check(self.cfg)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = tmp / "haproxy.log"
        # -W: master-worker, so SIGUSR2 reloads; -db: stay in the foreground
        self.proc = subprocess.Popen([HAPROXY, "-W", "-db", "-f", str(self.cfg)], stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/ws"
        deadline = time.monotonic() + 30
        while True:  # up, and every replica checked healthy
            try:
                if all(self.model(f"probe-{i}") for i in range(8)):
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)

    def model(self, route: str) -> str:
        """The replica (its served model name) that a route lands on."""
        return httpx.get(f"{self.url}/v1/models", headers={"X-Sluice-Route": route}).json()["data"][0]["id"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[Proxy, list[Server]]]:
    tmp = tmp_path_factory.mktemp("proxy")
    servers = [spawn_server(tmp, *FLAGS, f"--served-model-name=replica-{i}") for i in range(REPLICAS)]
    for s in servers:
        wait_healthy(s)
    proxy = Proxy(tmp, servers)
    yield proxy, servers
    proxy.stop()
    for s in servers:
        s.stop()


def test_the_generator_writes_configs_haproxy_accepts(tmp_path) -> None:
    for args in (["--replica=10.0.0.1:8000", "--replica=10.0.0.2:8000"],
                 ["--replicas-dns=sluice:8000", "--count=4"], ["--replica=10.0.0.1:8000", "--rate-limit=0"]):
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(render("--bind", ":8000", *args))
        check = haproxy_check(cfg)
        assert check.returncode == 0, check.stdout + check.stderr
    for bad in ([], ["--replica=10.0.0.1"], ["--replica=a:1", "--replicas-dns=b:2", "--count=1"],
                ["--replicas-dns=sluice:8000"], ["--replica=10.0.0.1:8000", "--rate-limit=-1"]):
        proc = subprocess.run([sys.executable, str(REPO / "deploy" / "haproxy.py"), *bad], capture_output=True,
                              text=True, check=False)
        assert proc.returncode == 2 and "error:" in proc.stderr, bad


def test_a_client_past_its_rate_gets_429_from_the_proxy_and_others_go_on(cluster, tmp_path) -> None:
    """The proxy bounds each client's requests (`--rate-limit` in 10 s; the shipped default, 1,000, is what the other
    tests run under): past it a client gets OpenAI's 429 (`rate_limit_exceeded`, with Retry-After) from the proxy,
    every request of it counted, while another address's requests go on. (The replicas share their loop per
    connecting address: the proxy's requests, everyone's, share one share, which one client's flood would spend.)
    The proxy listens on both IPv4 and IPv6 where it can: IPv4 clients then come as IPv4-mapped IPv6 addresses,
    each still a client of its own, not one IPv6 /64."""
    _, servers = cluster
    try:
        socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True).close()
        host = "::"  # (bound as ":::PORT": IPv6 and, through it, IPv4)
    except OSError:  # (no IPv6 here: IPv4 alone)
        host = "127.0.0.1"
    proxy = Proxy(tmp_path, servers, "--rate-limit=20", host=host)
    try:
        def client(address: str) -> httpx.Client:
            return httpx.Client(base_url=proxy.url, transport=httpx.HTTPTransport(local_address=address))

        with client("127.0.0.3") as flood, client("127.0.0.4") as other:
            assert [flood.get("/health").status_code for _ in range(24)] == [200] * 20 + [429] * 4
            r = flood.get("/v1/models")
            assert (r.status_code, r.headers["retry-after"], r.json()["error"]["code"]) == (
                429, "5", "rate_limit_exceeded"), r.text
            assert other.get("/health").status_code == 200 and other.get("/v1/models").status_code == 200
    finally:
        proxy.stop()


async def _ws_chat(url: str, route: str, max_tokens: int) -> tuple[str, dict]:
    async with connect(f"{url}?route={route}") as ws:
        ready = await recv(ws)
        assert ready["type"] == "ready"
        await send(ws, **user_chat("c", f"hello from {route}", max_tokens=max_tokens, ignore_eos=True))
        while (frame := await recv(ws))["type"] != "done":
            assert frame["type"] in ("start", "delta"), frame
        return ready["model"], frame


async def test_streams_pass_through_over_websocket_and_sse(cluster) -> None:
    proxy, _ = cluster
    model, done = await _ws_chat(proxy.ws_url, "ws-1", 8)
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 8
    assert model == proxy.model("ws-1")  # the query parameter routes as the header does
    body = {"model": proxy.model("sse-1"), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body,
                      headers={"X-Sluice-Route": "sse-1"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 8


async def test_a_conversations_second_turn_lands_where_its_prefix_is(cluster) -> None:
    """100 conversations, each with an opening no other shares: a cached prefix on turn two can only come from
    the replica that served turn one. Replicas answer only to their own model name: turn two names turn one's."""
    proxy, _ = cluster
    sem = asyncio.Semaphore(8)

    async def conversation(client: httpx.AsyncClient, i: int) -> tuple[str, str, int]:
        route = f"conversation-{i}"
        model = (await client.get("/v1/models", headers={"X-Sluice-Route": route})).json()["data"][0]["id"]
        messages = [{"role": "user", "content": f"Conversation {i}: tell me a story about the number {i * 37}, "
                                                "in the plainest words you know, please."}]
        async with sem:
            first = (await client.post("/v1/chat/completions", headers={"X-Sluice-Route": route}, json={
                "model": model, "messages": messages, "max_tokens": 4})).json()
            messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And then?"}]
            second = await client.post("/v1/chat/completions", headers={"X-Sluice-Route": route}, json={
                "model": first["model"], "messages": messages, "max_tokens": 4})
        if second.status_code != 200:  # another replica: it does not know turn one's model name
            return first["model"], "", 0
        second = second.json()
        return first["model"], second["model"], second["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as client:
        turns = await asyncio.gather(*(conversation(client, i) for i in range(100)))
    affine = sum(a == b and cached > 0 for a, b, cached in turns)
    assert affine >= 95, turns
    assert len({a for a, _, _ in turns}) == REPLICAS  # the keys spread over every replica


async def _long_ws(url: str, route: str, started: asyncio.Event | None = None) -> tuple[str, dict | str]:
    """A long chat; (replica, its `done` frame) or (replica, "closed") if the connection ended first."""
    async with connect(f"{url}?route={route}") as ws:
        model = (await recv(ws))["model"]
        await send(ws, **user_chat("c", f"a long one for {route}", max_tokens=LONG, ignore_eos=True))
        try:
            while (frame := await recv(ws, timeout=120))["type"] != "done":
                if frame["type"] == "delta" and started is not None:
                    started.set()
            return model, frame
        except ConnectionClosed:
            return model, "closed"


async def test_a_reload_under_load_drops_no_stream(cluster) -> None:
    proxy, _ = cluster
    routes = [f"reload-{i}" for i in range(6)]
    started = [asyncio.Event() for _ in routes]
    streams = [asyncio.create_task(_long_ws(proxy.ws_url, r, e)) for r, e in zip(routes, started)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    proxy.proc.send_signal(signal.SIGUSR2)  # the master starts new workers; the old ones keep their streams
    assert proxy.model("after-reload")  # new requests are served meanwhile
    results = await asyncio.wait_for(asyncio.gather(*streams), 300)
    for model, done in results:
        assert done != "closed" and done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == LONG
    assert proxy.proc.poll() is None


async def test_a_killed_replica_ends_its_streams_cleanly_and_new_chats_go_on(cluster) -> None:
    proxy, servers = cluster
    by_replica: dict[str, str] = {}  # one route landing on each replica
    for i in range(200):
        by_replica.setdefault(proxy.model(f"kill-{i}"), f"kill-{i}")
        if len(by_replica) == REPLICAS:
            break
    victim = servers[-1]
    victim_name = f"replica-{REPLICAS - 1}"
    started = {name: asyncio.Event() for name in by_replica}
    streams = {name: asyncio.create_task(_long_ws(proxy.ws_url, route, started[name]))
               for name, route in by_replica.items()}
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
    victim.proc.kill()
    victim.proc.wait()
    model, done = await asyncio.wait_for(streams.pop(victim_name), 60)  # ends at once, never hangs
    assert model == victim_name and done == "closed"
    # new chats, among them routes that landed on the victim: served by the others
    fresh = await asyncio.wait_for(asyncio.gather(*(_ws_chat(proxy.ws_url, f"after-kill-{i}", 4) for i in range(12))),
                                   120)
    assert all(d["finish_reason"] == "length" for _, d in fresh)
    assert {m for m, _ in fresh} <= set(by_replica) - {victim_name}
    moved = await asyncio.wait_for(_ws_chat(proxy.ws_url, by_replica[victim_name], 4), 60)
    assert moved[0] != victim_name and moved[1]["finish_reason"] == "length"
    for model, done in await asyncio.wait_for(asyncio.gather(*streams.values()), 300):  # the others never noticed
        assert done != "closed" and done["usage"]["completion_tokens"] == LONG, model
