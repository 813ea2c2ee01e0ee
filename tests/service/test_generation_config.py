"""The model's generation config as the served requests' sampling defaults (vLLM's `--generation-config`), on every
API: chat and completions, the Responses API (which shows them) and the WebSocket. The model's config has top_k 1
(any temperature is greedy: the defaults reach the sampler, by construction) and max_new_tokens 5 (a cap on every
request's length)."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect

from service.app import build_app
from service.config import ServerConfig
from tests.engine.test_generation_config import model_with
from tests.service.conftest import check_chat_frames, collect, in_process, recv, send, user_chat

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_with(tiny_model_dir, tmp_path_factory.mktemp("gen") / "m",
                      {"do_sample": True, "temperature": 0.5, "top_k": 1, "top_p": 0.9, "max_new_tokens": 5})


def config(model: Path, **kw) -> ServerConfig:
    return ServerConfig(**{"model": str(model), "dtype": "float32", "num_kv_blocks": 256, "max_model_len": 512,
                           "engine_process": False, **kw})


async def test_served_requests_take_the_models_defaults(model: Path) -> None:
    with in_process(build_app(config(model)), "gen-server") as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
            async def chat(**kw) -> dict:
                r = await http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, **kw})
                assert r.status_code == 200, r.text
                return r.json()

            unset = await chat()
            assert unset["usage"]["completion_tokens"] == 5 and unset["choices"][0]["finish_reason"] == "length"
            greedy = await chat(temperature=0, max_tokens=5)
            # top_k 1 from the model: temperature 1.0 (asked for) is greedy too
            hot = await chat(temperature=1.0, seed=3)
            assert unset["choices"][0]["message"] == greedy["choices"][0]["message"] == hot["choices"][0]["message"]
            assert (await chat(max_tokens=3))["usage"]["completion_tokens"] == 3
            assert (await chat(max_tokens=50))["usage"]["completion_tokens"] == 5  # capped (vLLM's max_new_tokens)
            r = await http.post("/v1/completions", json={"model": "m", "prompt": "The sea"})  # (OpenAI's 16, capped)
            assert r.json()["usage"]["completion_tokens"] == 5
            # the Responses API shows what it ran with: the model's temperature and top_p, or the request's
            resp = (await http.post("/v1/responses", json={"model": "m", "input": "Hi"})).json()
            assert (resp["temperature"], resp["top_p"]) == (0.5, 0.9), resp
            resp = (await http.post("/v1/responses", json={"model": "m", "input": "Hi", "temperature": 0.2})).json()
            assert (resp["temperature"], resp["top_p"]) == (0.2, 0.9)
        async with connect(s.ws_url) as ws:
            ready = await recv(ws)  # (the model's defaults, for a client that shows them: the UI's sliders)
            assert ready["defaults"] == {"temperature": 0.5, "top_k": 1, "top_p": 0.9, "max_tokens": 5}
            await send(ws, **user_chat("c", "Tell me about the sea"))
            text, done = check_chat_frames((await collect(ws, {"c"}))["c"])
            assert done["usage"]["completion_tokens"] == 5 and text == unset["choices"][0]["message"]["content"]


async def test_generation_config_vllm_and_the_override(model: Path) -> None:
    """`--generation-config vllm`: none of the model's (temperature 1, OpenAI's 16 tokens for a completion); the
    override alone then."""
    with in_process(build_app(config(model, generation_config="vllm")), "gen-vllm") as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
            r = await http.post("/v1/completions", json={"model": "m", "prompt": "The sea", "temperature": 0})
            assert r.json()["usage"]["completion_tokens"] == 16
            resp = (await http.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 4})).json()
            assert (resp["temperature"], resp["top_p"]) == (1.0, 1.0)
    override = {"max_new_tokens": 2, "temperature": 0.25}
    with in_process(build_app(config(model, generation_config="vllm", override_generation_config=override)),
                    "gen-override") as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
            resp = (await http.post("/v1/responses", json={"model": "m", "input": "Hi"})).json()
            assert (resp["temperature"], resp["top_p"], resp["usage"]["output_tokens"]) == (0.25, 1.0, 2)


async def test_a_max_new_tokens_beyond_the_context_is_capped_to_it(model: Path) -> None:
    """The generation config's max_new_tokens is a default, capped to what the context leaves (vLLM's min of the two):
    a chat that asks for no length is not refused for it; one that asks for more than the context is (OpenAI's 400)."""
    cfg = config(model, max_model_len=48, override_generation_config={"max_new_tokens": 1000})
    with in_process(build_app(cfg), "gen-cap") as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 48
            r = await http.post("/v1/responses", json={"model": "m", "input": "Hi"})
            assert r.status_code == 200 and sum(r.json()["usage"][k] for k in ("input_tokens", "output_tokens")) <= 48
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 100})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_the_flags(model: Path) -> None:
    from service.config import parse_config

    c = parse_config(["--generation-config", "vllm", "--override-generation-config", json.dumps({"top_p": 0.5})])
    assert c.engine_kwargs()["generation_config"] == "vllm"
    assert c.engine_kwargs()["override_generation_config"] == {"top_p": 0.5}
    with pytest.raises(SystemExit):
        parse_config(["--override-generation-config", "[1]"])
