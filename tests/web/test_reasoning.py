"""A reasoning model in the browser (`--reasoning-parser`, the WebSocket delta's `reasoning`): its thinking folded above
the answer (web/view.js), kept across a reload, never sent back in the history. The tiny model never writes
`</think>`, so under deepseek_r1 its whole answer is reasoning."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from tests.server import Server, spawn_server, wait_healthy
from tests.web.common import LONG, UI
from tests.web.conftest import _checked_page


@pytest.fixture(scope="module")
def reasoning_server(browser, no_eos_model_dir, tmp_path_factory) -> Iterator[Server]:
    srv = spawn_server(tmp_path_factory.mktemp("reasoning"), "--model", str(no_eos_model_dir),
                       "--reasoning-parser", "deepseek_r1")
    try:
        yield wait_healthy(srv)
    finally:
        srv.stop()


@pytest.fixture
def reasoning_ui(browser, reasoning_server: Server) -> Iterator[UI]:
    yield from _checked_page(browser, reasoning_server.url)


def test_thinking_is_folded_above_the_answer(reasoning_ui: UI) -> None:
    ui = reasoning_ui
    page = ui.page
    ui.open()
    ui.setting("max_tokens", LONG)
    ui.send("think first")
    answer = ui.last_answer()
    thinking = answer.locator("details.thinking")
    expect(thinking.locator("summary")).to_have_text("Thinking…")  # (streaming, no answer text yet)
    expect(thinking).not_to_have_attribute("open", "")  # folded unless the reader opens it
    thinking.locator("summary").click()
    expect(thinking).to_have_attribute("open", "")
    expect(thinking.locator(".thinking-body")).not_to_be_empty()
    page.click("#send")  # stop
    expect(answer).to_have_attribute("data-status", "cancelled")
    expect(thinking.locator("summary")).to_have_text("Reasoning")
    expect(thinking).to_have_attribute("open", "")  # (repainting kept the reader's choice)
    chat_id = ui.last_chat_id()
    deltas = ui.frames("delta", chat_id)
    reasoning = "".join(f.get("reasoning", "") for f in deltas)
    assert reasoning and not "".join(f["text"] for f in deltas)
    assert thinking.locator(".thinking-body").text_content().split() == reasoning.split()
    expect(answer.locator(".body")).to_be_empty()
    # kept across a reload; the next turn's history has no reasoning (the answer had no text: an empty turn)
    page.reload()
    ui.wait_connected()
    expect(ui.last_answer().locator(".thinking-body")).not_to_be_empty()
    ui.setting("max_tokens", 4)
    ui.send("and now?")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    history = [f for f in ui.sent if f["type"] == "chat"][-1]["messages"]
    assert [m["role"] for m in history if m["role"] != "system"] == ["user", "assistant", "user"] and not any(
        reasoning[:20] in m["content"] for m in history)
