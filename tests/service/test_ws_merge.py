"""The WebSocket writer (service/ws.py) merges a slow reader's pending output: no socket, no engine,
a real `Connection` whose socket send blocks until the test lets it through."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from service.config import ServerConfig
from service.handle import RequestHandle
from service.metrics import Metrics
from service.ws import Connection, _Chat


class StalledSocket:
    """send_text waits for `gate`: a client that is not reading."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sending = asyncio.Event()
        self.sent: list[dict] = []
        self.close_code: int | None = None

    async def send_text(self, data: str) -> None:
        self.sending.set()
        await self.gate.wait()
        self.sent.append(json.loads(data))

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.close_code = code


async def test_slow_reader_gets_merged_deltas_then_done() -> None:
    sock = StalledSocket()
    svc = SimpleNamespace(config=ServerConfig(), metrics=Metrics(lambda: {}), connections=set(),
                          bridge=SimpleNamespace(abort=lambda handle: None))
    conn = Connection(sock, svc)  # type: ignore[arg-type]
    chat = _Chat("c1")
    handle = chat.handle = RequestHandle("r1", "ws", lambda: conn._mark(chat))
    conn.chats["c1"] = chat
    writer = asyncio.create_task(conn._write_loop())

    handle.prompt_tokens, handle.cached_tokens = 7, 4
    handle.push("Hel", 1, None)
    handle.notify()
    await asyncio.wait_for(sock.sending.wait(), 5)  # the writer is now stuck sending `start`
    for piece in ["lo", ", ", "wor", "ld"]:  # four more engine steps while the reader sleeps
        handle.push(piece, 1, None)
        handle.notify()
    handle.finish("stop", None)
    handle.notify()
    sock.gate.set()
    conn.shutdown(1001)
    await asyncio.wait_for(writer, 5)

    kinds = [f["type"] for f in sock.sent]
    assert kinds == ["start", "delta", "delta", "done"], sock.sent
    assert sock.sent[0] == {"type": "start", "id": "c1", "prompt_tokens": 7, "cached_tokens": 4}
    assert [(f["text"], f["tokens"]) for f in sock.sent[1:3]] == [("Hel", 1), ("lo, world", 4)]
    assert sock.sent[3]["finish_reason"] == "stop" and sock.sent[3]["usage"]["completion_tokens"] == 5
    assert "c1" not in conn.chats and sock.close_code == 1001


async def test_withheld_text_carries_its_tokens_to_the_next_delta() -> None:
    sock = StalledSocket()
    sock.gate.set()
    svc = SimpleNamespace(config=ServerConfig(), metrics=Metrics(lambda: {}), connections=set(),
                          bridge=SimpleNamespace(abort=lambda handle: None))
    conn = Connection(sock, svc)  # type: ignore[arg-type]
    chat = _Chat("c")
    chat.handle = RequestHandle("r", "ws", lambda: None)
    chat.handle.prompt_tokens = 1
    chat.handle.push("", 1, None)  # half a UTF-8 character: the engine withholds its text
    assert [f.__struct_config__.tag for f in conn._frames(chat)] == ["start"]
    chat.handle.push("é", 1, None)
    (delta,) = conn._frames(chat)
    assert (delta.text, delta.tokens) == ("é", 2)
