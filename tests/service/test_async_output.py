"""`sluice serve --async-output-proc` and `--async-scheduling`: the same chats stream the same text as the shared
server's plain loop, a cancelled chat ends as one, and the server exits cleanly (its forward thread with it)."""
from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect

from tests.server import start_server
from tests.service.conftest import LONG, MAIN_FLAGS, check_chat_frames, collect, recv, send, user_chat

pytestmark = pytest.mark.timeout(300)

# greedy: sampled tokens, even seeded, may change with the batch a request happens to share (a row's logits can
# differ in the last bits with the GEMM's shape), and the two servers batch by arrival (the engine tests compare
# seeded streams in identical batches)
CHATS = [("a", "Hello there, how are you?", {"max_tokens": 40}),
         ("b", "Tell me about lists.", {"max_tokens": 25, "stop": ["e"]}),
         ("c", "And dictionaries?", {"max_tokens": 30})]


async def _texts(url: str) -> dict[str, tuple[str, str]]:
    async with connect(url) as ws:
        assert (await recv(ws))["type"] == "ready"
        for cid, content, params in CHATS:
            await send(ws, **user_chat(cid, content, temperature=0.0, **params))
        frames = await collect(ws, {cid for cid, _, _ in CHATS})
    out = {}
    for cid, f in frames.items():
        text, done = check_chat_frames(f)
        out[cid] = (text, done["finish_reason"])
    return out


@pytest.mark.parametrize("flag", ["--async-output-proc", "--async-scheduling"])
def test_served_streams_match_the_plain_loop(main_server, tmp_path, flag) -> None:
    server = start_server(tmp_path, *MAIN_FLAGS, flag)
    try:
        async def run() -> None:
            overlapped = await _texts(server.ws_url)
            assert overlapped == await _texts(main_server.ws_url)
            assert any(reason == "stop" for _, reason in overlapped.values())
            async with connect(server.ws_url) as ws:  # a chat cancelled while it streams
                assert (await recv(ws))["type"] == "ready"
                await send(ws, **user_chat("long", "Go on and on.", max_tokens=LONG, ignore_eos=True))
                while (await recv(ws))["type"] != "delta":
                    pass
                await send(ws, type="cancel", id="long")
                while (frame := await recv(ws))["type"] != "done":
                    assert frame["type"] == "delta", frame
                assert frame["finish_reason"] == "cancelled", frame

        asyncio.run(run())
    finally:
        assert server.stop() == 0, server.log_tail()
