"""`--chat-template` (vLLM's flag): a template file, or the template itself, in place of the model's own, used by every
chat the server templates (its tokenizer thread's and the engine's); a template that does not parse, or a value that
is neither a file nor a template, fails at start."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine import EngineConfig, LLMEngine
from engine.processor import InputProcessor
from service.app import build_app
from service.config import ServerConfig, parse_config
from tests.service.conftest import in_process

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if reasoning_effort is defined %}({{ reasoning_effort }}){% endif %}{% if add_generation_prompt %}>{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello there"}]


def test_the_servers_chat_template_replaces_the_models(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    config = ServerConfig(model=str(tiny_model_dir), served_model_name="m", num_kv_blocks=128, max_model_len=512,
                          engine_process=False, chat_template=str(tmp_path / "t.jinja"),
                          reasoning_parser="qwen3")  # (which reasoning_effort needs)
    with in_process(build_app(config), "template-server") as s, httpx.Client(base_url=s.url, timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "[user] Hello there\n>"
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
        # OpenAI's reasoning_effort is the template's variable (chat_template_kwargs', as vLLM gives it)
        ids = http.post("/tokenize", json={"messages": MESSAGES,
                                           "chat_template_kwargs": {"reasoning_effort": "high"}}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "[user] Hello there\n(high)>"
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 1,
                                                    "reasoning_effort": "high"})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
    # the engine's own API (a str chat templated on the engine thread) takes it too, inline
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=512,
                                    chat_template=TEMPLATE))
    assert engine.tokenizer.decode(engine.processor.chat_ids(MESSAGES)) == "[user] Hello there\n>"


def test_a_bad_template_fails_at_start(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(SystemExit):
        parse_config(["--chat-template", str(tmp_path / "missing.jinja")], {})
    with pytest.raises(ValueError, match="chat_template: line 1"):
        InputProcessor(tiny_model_dir, 1024, 512, chat_template="{% for m in messages %}")
