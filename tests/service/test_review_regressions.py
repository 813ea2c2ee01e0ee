"""Review repros (service/), in-process: a real EngineBridge over the tiny engine, no sockets."""
from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, LLMEngine
from service.bridge import EngineBridge
from service.handle import GenerateRequest, RequestError
from service.protocol import Chat, decode_client


async def _bridge(tiny_model_dir) -> EngineBridge:
    bridge = EngineBridge(lambda: LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                                         num_kv_blocks=64, max_model_len=256)), max_queued=16)
    bridge.start()
    for _ in range(600):
        if bridge.ready:
            return bridge
        await asyncio.sleep(0.05)
    raise AssertionError("engine not ready")


async def _run(bridge: EngineBridge, req: GenerateRequest) -> RequestError | None:
    done = asyncio.Event()
    try:
        h = bridge.submit(req, done.set)
    except RequestError as e:
        return e
    while not h.finished:
        done.clear()
        await asyncio.wait_for(done.wait(), 60)
    return h.error


# F5: every ValueError out of engine.add_request is reported as `prompt_too_long` (bridge.py `_admit`), so a
# bad seed (POST /v1/completions {"seed": 2**64}; OpenAI `seed: int | None` has no bounds, torch's
# manual_seed raises ValueError) or an out-of-vocab token id (bridge checks len(tokenizer), engine checks
# config vocab_size) comes back as HTTP 400 `context_length_exceeded` -- a wrong, misleading code.
@pytest.mark.parametrize("sampling", [{"seed": 2**64}, {"seed": -(2**63) - 1}])
async def test_bad_seed_is_not_reported_as_prompt_too_long(tiny_model_dir, sampling):
    bridge = await _bridge(tiny_model_dir)
    try:
        err = await _run(bridge, GenerateRequest(prompt="hello", chat=False, sampling=sampling, max_tokens=2))
        assert err is not None and err.code == "invalid_message", f"got {err and (err.code, err.message)}"
    finally:
        await bridge.stop()


# F1 at the wire: PROTOCOL chat frames accept a top_k that no engine can use (and that fails the whole step).
def test_ws_chat_rejects_top_k_beyond_int64():
    msg = decode_client('{"type":"chat","id":"c","messages":[{"role":"user","content":"x"}],"top_k":1e30}'
                        .replace("1e30", str(10**30)))
    assert not isinstance(msg, Chat), "top_k=10**30 accepted by the protocol decoder"
