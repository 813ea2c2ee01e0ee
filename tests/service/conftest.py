"""Real `sluice serve` subprocesses on free loopback ports (embedded tiny model), plus WebSocket helpers.

`main_server` (tests/conftest.py) is shared by the whole session; modules with special flags start their own.
Servers run with OMP_NUM_THREADS=1: on a small shared CPU box torch's spinning worker threads
slow every step several-fold, and the in-process reference engine uses the same setting.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect

from service.config import ServerConfig
from service.state import Service
from tests.server import REPO, Server, free_port, start_server  # noqa: F401  (re-exported to the tests)

# Flags of the shared server; the reference engine in test_ws.py is built from the same values.
MAIN_ENGINE = {"num_kv_blocks": 2048, "block_size": 16, "max_model_len": 4096, "max_num_batched_tokens": 256}
MAIN_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in MAIN_ENGINE.items()] + [
    "--max-inflight-per-connection=4", "--max-message-bytes=65536"]
# NOTE: a chat that must still be running when a test acts on it (cancel, hang up, close) asks for all the
# context a short prompt leaves: thousands of engine steps by construction, so no CPU is fast enough to
# finish it between the event the test waits for and its next move. Never a number of seconds.
LONG = MAIN_ENGINE["max_model_len"] - 128
TOO_LONG = "word " * 1500  # 4,500 prompt tokens (three a word): over max_model_len


# ---- WebSocket helpers ----------------------------------------------------------------------
async def recv(ws: ClientConnection, timeout: float = 60.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def send(ws: ClientConnection, **msg: Any) -> None:
    await ws.send(json.dumps(msg))


async def open_ws(server: Server, **kwargs: Any) -> ClientConnection:
    """Connected and past `ready` (no API key); over wss:// to a server started with TLS."""
    if getattr(server, "tls", None) is not None:  # (an `in_process` server has none)
        kwargs.setdefault("ssl", server.tls)
    ws = await connect(server.ws_url, max_size=None, **kwargs)
    ready = await recv(ws)
    assert ready["type"] == "ready", ready
    return ws


async def collect(ws: ClientConnection, ids: set[str], timeout: float = 120.0) -> dict[str, list[dict[str, Any]]]:
    """All frames for `ids` until each has its done/error; frames for other ids fail the test."""
    frames: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    open_ids = set(ids)
    deadline = time.monotonic() + timeout
    while open_ids:
        msg = await recv(ws, deadline - time.monotonic())
        assert msg.get("id") in frames, f"unexpected frame {msg}"
        assert msg["id"] in open_ids, f"frame after the end of chat {msg['id']}: {msg}"
        frames[msg["id"]].append(msg)
        if msg["type"] in ("done", "error"):
            open_ids.discard(msg["id"])
    return frames


def check_chat_frames(frames: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """start, delta*, done in that order; returns (text, done)."""
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "start" and kinds[-1] == "done" and set(kinds[1:-1]) <= {"delta"}, kinds
    text = "".join(f["text"] for f in frames if f["type"] == "delta")
    assert sum(f["tokens"] for f in frames if f["type"] == "delta") <= frames[-1]["usage"]["completion_tokens"]
    return text, frames[-1]


async def wait_running(ws: ClientConnection, n: int = 1, timeout: float = 20.0) -> dict[str, Any]:
    """Poll `stats` until at least n requests run (admitted, past the queue)."""
    deadline = time.monotonic() + timeout
    while True:
        await send(ws, type="stats")
        stats = await recv(ws)
        if stats["num_running"] >= n:
            return stats
        assert time.monotonic() < deadline, f"nothing running: {stats}"
        await asyncio.sleep(0.01)


async def wait_engine_idle(ws: ClientConnection, timeout: float = 20.0) -> dict[str, Any]:
    """Poll `stats` until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        await send(ws, type="stats")
        stats = await recv(ws)
        assert stats["type"] == "stats", stats
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]):
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.1)


def user_chat(chat_id: str, content: str, **params: Any) -> dict[str, Any]:
    return {"type": "chat", "id": chat_id, "messages": [{"role": "user", "content": content}], **params}


def finished_requests(server: Server) -> dict[str, float]:
    """`sluice_requests_total` from the server's /metrics, summed over APIs: finish reason -> requests."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            if sample.name == "sluice_requests_total":
                reason = sample.labels["finish_reason"]
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


@contextlib.contextmanager
def in_process(app: Any, name: str) -> Iterator[SimpleNamespace]:
    """`app` (from `service.app.build_app`, e.g. over a faulty engine factory) under uvicorn in a thread of this
    process, healthy; `url`, `ws_url` and `app` on what it yields."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, ws="websockets-sansio",
                                           ws_per_message_deflate=False, log_config=None))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not (server.started and httpx.get(f"{url}/health").status_code == 200):
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not become healthy"
        time.sleep(0.1)
    yield SimpleNamespace(url=url, ws_url=f"ws://127.0.0.1:{port}/v1/ws", app=app)
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


def idle_service(**config: Any) -> Service:
    """A real `Service` whose engine is never started: the WebSocket tests without an engine feed its handles by hand,
    as the bridge would."""

    def no_engine() -> Any:
        raise AssertionError("these tests never start the engine")

    return Service(ServerConfig(**config), no_engine)


# a Hermes-style template (Qwen2.5's, shortened) for the tool-calling tests: the tools in a system turn, calls and
# results in their own
TOOLS_TEMPLATE = (
    "{%- if enable_thinking is defined and not enable_thinking %}<|im_start|>system\nno thinking<|im_end|>\n"
    "{% endif %}"
    "{%- if documents %}<|im_start|>system\n{% for d in documents %}{{ d['title'] }}: {{ d['text'] }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and 'tool_calls' in m %}<|im_start|>assistant\n"
    "{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], 'arguments': "
    "c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tools_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model under `TOOLS_TEMPLATE`."""
    out = tmp_path_factory.mktemp("tools-model")
    for f in tiny_model_dir.iterdir():
        (out / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy(f, out / f.name)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return out
