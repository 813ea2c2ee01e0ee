"""SIGTERM mid-stream: `/health` answers 503 `draining` (the listener stays open for load balancers to
see it), new chats are refused, the stream in flight completes in full, its socket closes with 1001,
and the process exits 0. An engine that cannot start makes the process exit 1 instead of serving 503
forever."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed

from tests.service.conftest import LONG, REPO, check_chat_frames, free_port, open_ws, recv, start_server, user_chat

TOKENS = LONG  # still streaming when the late chat arrives, however fast the CPU


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def test_sigterm_lets_the_stream_finish_then_exits_0(tiny_model_dir, tmp_path) -> None:
    # (a grace period far beyond the drain: the test is about draining, on however slow a CPU)
    server = start_server(tmp_path, "--num-kv-blocks=512", "--timeout-graceful-shutdown=600")
    try:
        ws = await open_ws(server)
        await ws.send(json.dumps(user_chat("s", "tell me everything", max_tokens=TOKENS, ignore_eos=True)))
        frames = [await recv(ws), await recv(ws)]
        assert [f["type"] for f in frames] == ["start", "delta"]
        server.proc.send_signal(signal.SIGTERM)

        for _ in range(100):  # draining within a tick of the signal, and the listener still answers
            status, body = await asyncio.to_thread(_health, server.url)
            if status != 200:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("server still healthy after SIGTERM")
        assert (status, body) == (503, {"status": "draining"})
        await ws.send(json.dumps(user_chat("late", "hi")))

        late = None
        while True:
            msg = await recv(ws)
            if msg.get("id") == "late":
                late = msg
                continue
            frames.append(msg)
            if msg["type"] in ("done", "error"):
                break
        _, done = check_chat_frames(frames)
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == TOKENS
        assert late is not None and late["type"] == "error" and late["code"] == "overloaded"
        with pytest.raises(ConnectionClosed) as info:
            await recv(ws)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1001
        assert await asyncio.to_thread(server.proc.wait, 30) == 0, server.log_text()[-3000:]
    finally:
        server.stop()


@pytest.mark.parametrize("model, says", [("", "no config.json"), ("nope", "does not exist")])
def test_engine_that_cannot_load_its_model_exits_1_saying_why(tmp_path, model, says) -> None:
    model_dir = tmp_path / model
    proc = subprocess.run([sys.executable, "-m", "service", "--port", str(free_port()), "--model", str(model_dir)],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "cannot load the model: " in proc.stderr and says in proc.stderr and str(model_dir) in proc.stderr
    assert "Traceback" not in proc.stderr  # a configuration mistake, not a crash
