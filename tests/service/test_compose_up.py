"""`docker compose`, run for real: README's Deploy commands against a Docker engine, when one is reachable.

The stack is compose.yaml as shipped (the CPU image), under a project name of its own and a free host port,
and is removed with its volume at the end (the image stays, so a second run builds from cache). Checked:
healthy, published on 127.0.0.1 only, runs as uid 10001; the UI, a WebSocket chat, an OpenAI chat, metrics;
`stop` drains chats in flight and exits 0; the second `up` reuses the volume (no model build, no kernel
compile); an unreadable model and a missing models directory fail saying why. The GPU variant is checked by
`docker compose config` only (a GPU host runs the same commands with COMPOSE_FILE=compose.yaml:compose.gpu.yaml).

Skips, saying why, where no Docker engine with Compose v2 is reachable (CI has none). Builds take their
packages from the network: a torch mirror is SLUICE_TORCH_INDEX (compose.yaml passes it through), other build
arguments SLUICE_TEST_BUILD_ARGS ("NAME=value NAME=value", e.g. PIP_TRUSTED_HOST=mirror for a plain-http one).
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.server import REPO, free_port
from tests.service.conftest import check_chat_frames, collect, recv, send, user_chat

pytestmark = pytest.mark.timeout(2400)  # a first build downloads torch and the pinned dependencies

PROJECT = f"sluice-test-{os.getpid()}"
MODEL_POSITIONS = 2048  # the embedded default model's context (engine/sluice-chat)
LONG = MODEL_POSITIONS - 128  # chats that must still run when `stop` comes: thousands of steps by construction


def _docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


@functools.cache
def _why_not(engine: bool = True) -> str | None:
    """Why these tests cannot run here (None: they can). Asked when the first test runs, never at collection."""
    if shutil.which("docker") is None:
        return "no `docker` command on this machine"
    try:
        if _docker("compose", "version", "--short", timeout=20).returncode != 0:
            return "no Compose v2 (`docker compose`) plugin"
        if engine and (info := _docker("info", "--format", "{{.ServerVersion}}", timeout=20)).returncode != 0:
            return f"no Docker engine reachable: {(info.stderr or info.stdout).strip().splitlines()[-1:]}"
    except subprocess.TimeoutExpired:
        return "the Docker CLI or engine does not answer"
    return None


@pytest.fixture(scope="module")
def docker_engine() -> None:
    if (why := _why_not()) is not None:
        pytest.skip(f"compose smoke test: {why}")


@dataclass
class Stack:
    port: int
    env: dict[str, str]
    models: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", "compose", *args], cwd=REPO, env={**self.env, **env}, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def ok(self, *args: str, timeout: float = 120, **env: str) -> str:
        r = self.compose(*args, timeout=timeout, **env)
        assert r.returncode == 0, f"docker compose {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def container(self) -> dict:
        cid = self.ok("ps", "-a", "-q", "sluice").strip()
        return json.loads(_docker("inspect", cid).stdout)[0]

    def logs(self) -> str:
        return self.ok("logs", "--no-log-prefix", "sluice")


def _unreadable_model(models: Path) -> None:
    """A copy of a model as `cp` of safetensors' own output leaves it: model.safetensors 0600."""
    from engine.tiny import build

    build("tiny", models / "unreadable", progress=False)
    (models / "unreadable" / "model.safetensors").chmod(0o600)


@pytest.fixture(scope="module")
def stack(docker_engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    models = tmp_path_factory.mktemp("models")
    models.chmod(0o755)
    _unreadable_model(models)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}  # not a GPU host's COMPOSE_FILE
    env.update(COMPOSE_PROJECT_NAME=PROJECT, SLUICE_PUBLISHED_PORT=str(free_port()), SLUICE_MODELS_DIR=str(models))
    s = Stack(int(env["SLUICE_PUBLISHED_PORT"]), env, models)
    build_args = [a for kv in shlex.split(os.environ.get("SLUICE_TEST_BUILD_ARGS", "")) for a in ("--build-arg", kv)]
    try:
        s.ok("build", *build_args, timeout=1800)
        started = time.monotonic()
        s.ok("up", "-d", "--wait", "--wait-timeout", "300", timeout=400)
        print(f"\nfirst up: healthy in {time.monotonic() - started:.1f} s")
        yield s
    finally:
        print(s.compose("logs", "--no-log-prefix", "--tail", "30").stdout)
        s.compose("down", "-v", "--remove-orphans", timeout=120)


def _chat(ws_url: str, n: int) -> dict[str, list[dict]]:
    async def run() -> dict[str, list[dict]]:
        async with connect(ws_url, max_size=None) as ws:
            assert (await recv(ws))["type"] == "ready"
            for i in range(n):
                await send(ws, **user_chat(f"c{i}", "Hello from compose!", max_tokens=16))
            return await collect(ws, {f"c{i}" for i in range(n)})
    return asyncio.run(run())


def test_healthy_on_loopback_only_as_an_unprivileged_user(stack: Stack) -> None:
    c = stack.container()
    assert c["State"]["Health"]["Status"] == "healthy"
    assert c["Config"]["User"] == "10001"
    assert stack.ok("exec", "-T", "sluice", "id", "-u").strip() == "10001"
    bindings = c["HostConfig"]["PortBindings"]["8000/tcp"]
    assert bindings == [{"HostIp": "127.0.0.1", "HostPort": str(stack.port)}]
    # the image holds the installed package, no source tree beside it
    where = stack.ok("exec", "-T", "sluice", "python", "-c", "import service, service.app as a; print(service.__file__, a.web_dir())")
    assert "/site-packages/service/" in where and "/share/sluice/web" in where, where


def test_ui_websocket_chat_openai_chat_and_metrics(stack: Stack) -> None:
    ui = httpx.get(f"{stack.url}/", timeout=30)
    assert ui.status_code == 200 and "text/html" in ui.headers["content-type"] and "<script" in ui.text
    frames = _chat(f"ws://127.0.0.1:{stack.port}/v1/ws", 2)
    for chat in frames.values():
        _, done = check_chat_frames(chat)
        assert done["finish_reason"] in ("stop", "length") and done["usage"]["completion_tokens"] >= 1
    model = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=120,
                   json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    metrics = httpx.get(f"{stack.url}/metrics", timeout=30).text
    assert 'sluice_requests_total{api="ws"' in metrics and 'sluice_requests_total{api="chat"' in metrics
    assert '"GET /health HTTP/1.1" 200' not in stack.logs()  # the healthcheck probes every 10 s, silently


def test_stop_drains_chats_in_flight_exits_0_and_the_next_up_reuses_the_volume(stack: Stack) -> None:
    n = 4

    async def run() -> tuple[dict[str, list[dict]], subprocess.CompletedProcess[str], float]:
        async with connect(f"ws://127.0.0.1:{stack.port}/v1/ws", max_size=None) as ws:
            assert (await recv(ws))["type"] == "ready"
            ids = {f"long{i}" for i in range(n)}
            for i in sorted(ids):
                await send(ws, **user_chat(i, "tell me everything", max_tokens=LONG, ignore_eos=True))
            frames: dict[str, list[dict]] = {i: [] for i in ids}
            while any(len(f) < 2 for f in frames.values()):  # every chat has started and streamed a delta
                msg = await recv(ws)
                frames[msg["id"]].append(msg)
            started = time.monotonic()
            stop = asyncio.create_task(asyncio.to_thread(stack.compose, "stop", timeout=120))
            rest = await collect(ws, ids, timeout=120)
            result = await stop
            for i in ids:
                frames[i] += rest[i]
            return frames, result, time.monotonic() - started

    frames, stop, took = asyncio.run(run())
    assert stop.returncode == 0, stop.stderr
    for chat in frames.values():
        _, done = check_chat_frames(chat)  # every chat ends with `done`: finished, or cancelled at the drain limit
        assert done["finish_reason"] in ("length", "cancelled"), done
    state = stack.container()["State"]
    assert (state["Status"], state["ExitCode"]) == ("exited", 0), state  # drained in time: SIGKILL would be 137
    print(f"\nstop with {n} chats in flight: {took:.1f} s, finish reasons "
          f"{sorted(c[-1]['finish_reason'] for c in frames.values())}")

    started = time.monotonic()
    stack.ok("up", "-d", "--wait", "--wait-timeout", "300", timeout=400)
    print(f"second up: healthy in {time.monotonic() - started:.1f} s")
    runs = stack.logs().split("Started server process")
    assert len(runs) == 3, "expected two starts of the same container"
    first, second = runs[1], runs[2]
    assert "compiling the native CPU kernels" in first  # the default model ships in the image: nothing to build
    assert "compiling" not in second  # the volume kept the kernels
    assert "engine ready" in second


def test_an_unreadable_model_fails_saying_why(stack: Stack) -> None:
    r = stack.compose("run", "--rm", "--no-deps", "sluice", timeout=300, SLUICE_MODEL="/models/unreadable")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "cannot load the model: model directory /models/unreadable is not readable by this process (uid 10001)" in out
    assert "model.safetensors (mode 0600" in out and "chmod -R a+rX" in out
    assert "Traceback" not in out


def test_a_missing_models_directory_is_an_error_not_created(stack: Stack, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-models"
    r = stack.compose("run", "--rm", "--no-deps", "sluice", timeout=300, SLUICE_MODELS_DIR=str(missing))
    assert r.returncode != 0 and "does not exist" in r.stderr, r.stdout + r.stderr
    assert not missing.exists()


def test_gpu_variant_as_compose_resolves_it() -> None:
    if (why := _why_not(engine=False)) is not None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    r = subprocess.run(["docker", "compose", "-f", "compose.yaml", "-f", "compose.gpu.yaml", "config", "--format", "json"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"]["sluice"]
    assert (svc["build"]["args"]["TARGET"], svc["image"], svc["environment"]["SLUICE_DEVICE"]) == ("cuda", "sluice:cuda", "cuda")
    assert svc["deploy"]["resources"]["reservations"]["devices"] == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert svc["ports"][0]["host_ip"] == "127.0.0.1" and svc["volumes"][0]["read_only"] is True


# ---- compose.scale.yaml: replicas behind HAProxy, for real ----------------------------------------------
@pytest.fixture(scope="module")
def scaled(docker_engine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """README's scaling command as written: two replicas of the CPU image behind the proxy image."""
    models = tmp_path_factory.mktemp("scale-models")
    models.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    env.update(COMPOSE_PROJECT_NAME=f"{PROJECT}-scale", COMPOSE_FILE="compose.yaml:compose.scale.yaml",
               SLUICE_REPLICAS="2", SLUICE_PUBLISHED_PORT=str(free_port()), SLUICE_MODELS_DIR=str(models))
    s = Stack(int(env["SLUICE_PUBLISHED_PORT"]), env, models)
    build_args = [a for kv in shlex.split(os.environ.get("SLUICE_TEST_BUILD_ARGS", "")) for a in ("--build-arg", kv)]
    try:
        s.ok("build", *build_args, timeout=1800)
        s.ok("up", "-d", "--wait", "--wait-timeout", "300", timeout=400)
        yield s
    finally:
        print(s.compose("logs", "--tail", "30").stdout)
        s.compose("down", "-v", "--remove-orphans", timeout=120)


def _replica_requests(stack: Stack) -> list[float]:
    """Finished WebSocket and chat requests per replica, from each one's own /metrics (inside its container)."""
    out = []
    for index in (1, 2):
        text = stack.ok("exec", "-T", "--index", str(index), "sluice", "python", "-c",
                        "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode())")
        out.append(sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("sluice_requests_total{")))
    return out


def test_scale_serves_through_the_proxy_only(scaled: Stack) -> None:
    ps = [json.loads(ln) for ln in scaled.ok("ps", "--format", "json").splitlines() if ln.strip()]
    by = {}
    for c in ps:
        by.setdefault(c["Service"], []).append(c)
    assert len(by["sluice"]) == 2 and len(by["proxy"]) == 1
    assert all("healthy" in c["Status"] for c in by["sluice"] + by["proxy"]), ps
    assert all(not c.get("Publishers") or not any(p.get("PublishedPort") for p in c["Publishers"]) for c in by["sluice"])
    frames = _chat(f"ws://127.0.0.1:{scaled.port}/v1/ws?route=browser-1", 2)
    for chat in frames.values():
        assert check_chat_frames(chat)[1]["finish_reason"] in ("stop", "length")


def test_scale_a_conversation_keeps_its_replica_and_the_keys_spread(scaled: Stack) -> None:
    """Turn two of each of 40 conversations (an opening no other shares) finds turn one's prefix cached: only the
    replica that served turn one has it. Both replicas serve some."""
    before = _replica_requests(scaled)
    model = httpx.get(f"{scaled.url}/v1/models", timeout=30).json()["data"][0]["id"]
    cached = []
    with httpx.Client(base_url=scaled.url, timeout=120) as client:
        for i in range(40):
            route = {"X-Sluice-Route": f"conversation-{i}"}
            messages = [{"role": "user", "content": f"Conversation {i}: a story about the number {i * 37}, "
                                                    "in the plainest words you know, please."}]
            first = client.post("/v1/chat/completions", headers=route,
                                json={"model": model, "messages": messages, "max_tokens": 4}).json()
            messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And then?"}]
            second = client.post("/v1/chat/completions", headers=route,
                                 json={"model": model, "messages": messages, "max_tokens": 4}).json()
            cached.append(second["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert sum(c > 0 for c in cached) >= 38, cached
    after = _replica_requests(scaled)
    assert all(a - b >= 5 for a, b in zip(after, before)), (before, after)


def test_scale_a_stopped_replica_leaves_the_other_serving_and_a_reload_drops_nothing(scaled: Stack) -> None:
    async def long_chat(route: str, started: asyncio.Event) -> dict:
        async with connect(f"ws://127.0.0.1:{scaled.port}/v1/ws?route={route}", max_size=None) as ws:
            assert (await recv(ws))["type"] == "ready"
            await send(ws, **user_chat("c", f"a long one for {route}", max_tokens=600, ignore_eos=True))
            while (frame := await recv(ws, timeout=120))["type"] != "done":
                started.set()
            return frame

    async def reload_under_load() -> list[dict]:
        started = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(long_chat(f"reload-{i}", e)) for i, e in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        scaled.ok("kill", "-s", "USR2", "proxy")  # HAProxy's master reloads: new workers, old streams kept
        return await asyncio.wait_for(asyncio.gather(*tasks), 600)

    for done in asyncio.run(reload_under_load()):
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 600
    one = [c for c in (json.loads(ln) for ln in scaled.ok("ps", "--format", "json").splitlines() if ln.strip())
           if c["Service"] == "sluice"][0]
    assert _docker("stop", one["Name"], timeout=120).returncode == 0  # a replica drains and goes
    deadline = time.monotonic() + 60
    while True:  # every route now lands on the other one (out after two failed checks)
        try:
            frames = _chat(f"ws://127.0.0.1:{scaled.port}/v1/ws?route=after-{time.monotonic()}", 1)
            assert all(check_chat_frames(c)[1]["finish_reason"] in ("stop", "length") for c in frames.values())
            if all(httpx.get(f"{scaled.url}/health", headers={"X-Sluice-Route": f"r{i}"}, timeout=10).status_code == 200
                   for i in range(10)):
                break
        except (AssertionError, httpx.HTTPError, OSError):
            pass
        assert time.monotonic() < deadline, "the proxy kept sending chats to the stopped replica"
        time.sleep(1)
    _docker("start", one["Name"], timeout=120)
