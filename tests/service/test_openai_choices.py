"""`openai_api._generate` and its streams over a bridge that is only handles (no engine): the order of events the
engine cannot be made to produce on cue (output that lands while a chunk is being written, one choice failing
while another runs) is driven here."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from engine import SamplingParams
from service import openai_api
from service.handle import GenerateRequest, RequestError, RequestHandle
from service.openai_errors import HTTPError
from service.openai_render import CompletionRender
from service.openai_schema import CompletionRequest


class Bridge:
    """Hands out handles the test drives; records aborts."""

    def __init__(self) -> None:
        self.handles: list[RequestHandle] = []
        self.aborted: list[str] = []
        self.submitted = asyncio.Event()

    def submit_choices(self, req: GenerateRequest, notify, params: list[SamplingParams]) -> list[RequestHandle]:
        new = [RequestHandle(str(len(self.handles) + i), "completions", notify) for i in range(len(params))]
        self.handles += new
        self.submitted.set()
        return new

    def abort(self, h: RequestHandle) -> None:
        self.aborted.append(h.request_id)


def _request() -> Request:
    async def receive() -> dict:  # a client that stays
        await asyncio.Event().wait()
        return {}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def _generate(bridge: Bridge, n: int, stream: bool) -> asyncio.Future:
    body = CompletionRequest(model="m", prompt="x", n=n, stream=stream)
    req = GenerateRequest(prompt="x", chat=False, params=SamplingParams(max_tokens=1000))
    return asyncio.ensure_future(openai_api._generate(_request(), SimpleNamespace(bridge=bridge), [req],
                                                      CompletionRender("m", False), body))


async def test_a_failed_choice_fails_the_response_at_once_and_stops_the_others() -> None:
    bridge = Bridge()
    task = _generate(bridge, 2, stream=False)
    await bridge.submitted.wait()
    failing, running = bridge.handles
    for h in (failing, running):
        h.start(3, 0, 0.0)
    running.push("a", 1, None)
    failing.finish(None, RequestError("internal", "the engine failed this request"))
    failing.notify()
    with pytest.raises(HTTPError) as e:
        await asyncio.wait_for(task, 60)  # `running` never finishes: the response must not wait for it
    assert e.value.status == 500 and bridge.aborted == [running.request_id]


async def test_output_that_lands_while_a_chunk_is_written_is_streamed() -> None:
    """The stream's write waits (a slow client): meanwhile the engine pushes the choice's last tokens and
    finishes it. They are sent before its finish chunk, not dropped."""
    bridge = Bridge()
    task = _generate(bridge, 1, stream=True)
    await bridge.submitted.wait()
    (h,) = bridge.handles
    h.start(3, 0, 0.0)
    h.push("A", 1, None)
    h.notify()
    response = await task
    sent: list[bytes] = []
    landed = asyncio.Event()

    async def send(message: dict) -> None:
        sent.append(message.get("body", b""))
        if b'"text":"A"' in sent[-1]:  # the engine's last step lands while this chunk is written
            h.push("B", 1, None)
            h.push("C", 1, None)
            h.finish("length", None)
            h.notify()
            landed.set()
        await asyncio.sleep(0)

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    await asyncio.wait_for(response({"type": "http"}, receive, send), 60)
    assert landed.is_set()
    events = [json.loads(e[6:]) for e in b"".join(sent).split(b"\n\n") if e.startswith(b"data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == "ABC"
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
