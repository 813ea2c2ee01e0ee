"""`sluice serve --tensor-parallel-size 2`, for real: the server starts its second rank (gloo on CPU), streams a
chat through both, and when that rank dies, the chat in flight ends (an error frame, or the socket closed by the
exiting server) and the server exits 1 (its
engine is not rebuilt over a broken group), leaving no process behind."""
from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.server import start_server
from tests.service.conftest import check_chat_frames, collect, recv, send, user_chat

pytestmark = pytest.mark.timeout(300)


def _children(pid: int) -> dict[int, str]:
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(pid): args for pid, args in (ln.split(None, 1) for ln in out.splitlines())}


def _alive(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def test_two_ranks_serve_and_a_dead_rank_ends_the_server(tmp_path) -> None:
    server = start_server(tmp_path, "--tensor-parallel-size=2", "--num-kv-blocks=256", "--max-model-len=2048")
    try:
        children = _children(server.proc.pid)  # the second rank (the first is the server) and multiprocessing's tracker
        ranks = [pid for pid, args in children.items() if "multiprocessing.spawn" in args]
        assert len(ranks) == 1, (children, server.log_tail())

        async def chat() -> None:
            async with connect(server.ws_url) as ws:
                assert (await recv(ws))["type"] == "ready"
                await send(ws, **user_chat("a", "Hello from two ranks!", max_tokens=16))
                frames = await collect(ws, {"a"})
                assert check_chat_frames(frames["a"])[1]["finish_reason"] in ("stop", "length")
                await send(ws, **user_chat("b", "and a long one", max_tokens=1500, ignore_eos=True))
                while (await recv(ws))["type"] != "delta":
                    pass
                subprocess.run(["kill", "-9", str(ranks[0])], check=True)
                try:  # an error frame, or the socket closed by the exiting server: either way, not a hang
                    while (frame := await recv(ws, timeout=120))["type"] not in ("error", "done"):
                        pass
                    assert frame["type"] == "error" or frame.get("finish_reason") == "error", frame
                except ConnectionClosed:
                    pass

        asyncio.run(chat())
        assert server.proc.wait(60) == 1, server.log_tail()
        assert "tensor-parallel engine is not rebuilt" in server.log_text(), server.log_tail()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children):  # nothing of it left behind
            assert time.monotonic() < deadline, {pid: _alive(pid) for pid in children}
            time.sleep(0.2)
    finally:
        server.stop()
