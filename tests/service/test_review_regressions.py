"""Review repros (service/), in-process: a real EngineBridge over the tiny engine, no sockets."""
from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from service.handle import GenerateRequest, RequestError, sampling_params
from service.protocol import Chat, decode_client


# F5: every ValueError out of engine.add_request is reported as `prompt_too_long` (bridge.py `_admit`), so a
# bad seed (POST /v1/completions {"seed": 2**64}; OpenAI `seed: int | None` has no bounds, torch's
# manual_seed raises ValueError) or an out-of-vocab token id (bridge checks len(tokenizer), engine checks
# config vocab_size) comes back as HTTP 400 `context_length_exceeded` -- a wrong, misleading code.
# Since SamplingParams is built once on the loop (service/handle.py `sampling_params`), the seed is refused there.
@pytest.mark.parametrize("sampling", [{"seed": 2**64}, {"seed": -(2**63) - 1}])
def test_bad_seed_is_not_reported_as_prompt_too_long(sampling):
    with pytest.raises(RequestError) as e:
        sampling_params({}, max_tokens=2, **sampling)
    assert e.value.code == "invalid_message" and e.value.param == "seed", (e.value.code, e.value.message)


# F1 at the wire: protocol chat frames accept a top_k that no engine can use (and that fails the whole step).
def test_ws_chat_rejects_top_k_beyond_int64():
    msg = decode_client('{"type":"chat","id":"c","messages":[{"role":"user","content":"x"}],"top_k":1e30}'
                        .replace("1e30", str(10**30)))
    assert not isinstance(msg, Chat), "top_k=10**30 accepted by the protocol decoder"


# Hostile-client finding 2: a streaming request whose client hung up in the same loop tick as its first
# output got a 499 and was never aborted; it generated to max_tokens for nobody.
async def test_disconnect_in_the_tick_of_the_first_output_aborts(tiny_model_dir):
    from starlette.requests import Request

    from service import openai_api
    from service.openai_schema import CompletionRequest
    from service.config import ServerConfig
    from service.state import Service

    svc = Service(ServerConfig(served_model_name="m", engine_process=False), lambda: LLMEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)))
    bridge = svc.bridge
    bridge.start()
    try:
        for _ in range(600):
            if bridge.ready:
                break
            await asyncio.sleep(0.05)
        async def receive() -> dict:  # hangs up in the tick the request's first output lands
            while not any(h.started for h in bridge._handles.values()):
                await asyncio.sleep(0)
            return {"type": "http.disconnect"}

        handles = []
        submit = bridge.submit_choices
        bridge.submit_choices = lambda req, notify, params: handles.extend(submit(req, notify, params)) or handles
        body = CompletionRequest(model="m", prompt="hello", stream=True)
        req = GenerateRequest(prompt="hello", chat=False, params=SamplingParams(ignore_eos=True, max_tokens=None),
                              api="completions")
        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        await openai_api._generate(request, svc, [req], openai_api.CompletionRender("m", False), body)
        (handle,) = handles
        for _ in range(1200):
            if handle.finished:
                break
            await asyncio.sleep(0.05)
        assert handle.finish_reason == "abort" and handle.completion_tokens < 250, \
            (handle.finish_reason, handle.completion_tokens)
    finally:
        await bridge.stop()
