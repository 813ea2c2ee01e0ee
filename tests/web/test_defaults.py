"""The chat UI samples with the model's defaults (the `ready` frame's `defaults`, from its generation_config.json:
`--generation-config`) until the reader moves a slider, and with its own (0.7, 1.0) for a model that has none."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from tests.server import Server, spawn_server, wait_healthy
from tests.web.common import UI
from tests.web.conftest import _checked_page


@pytest.fixture(scope="module")
def defaults_server(browser, no_eos_model_dir, tmp_path_factory) -> Iterator[Server]:
    model = tmp_path_factory.mktemp("defaults") / no_eos_model_dir.name
    shutil.copytree(no_eos_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.35, "top_p": 0.85, "top_k": 40}))
    srv = spawn_server(tmp_path_factory.mktemp("serve-defaults"), "--model", str(model))
    try:
        yield wait_healthy(srv)
    finally:
        srv.stop()


@pytest.fixture
def defaults_ui(browser, defaults_server: Server) -> Iterator[UI]:
    yield from _checked_page(browser, defaults_server.url)


def _sent(ui: UI) -> dict:
    return [f for f in ui.sent if f["type"] == "chat"][-1]


def test_the_models_defaults_until_a_slider_moves(defaults_ui: UI) -> None:
    ui, page = defaults_ui, defaults_ui.page
    ui.open()
    expect(page.locator("#temperature-out")).to_have_text("0.35 · default")
    expect(page.locator("#top_p-out")).to_have_text("0.85 · default")
    ui.setting("max_tokens", 3)
    ui.send("hello")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    assert (_sent(ui)["temperature"], _sent(ui)["top_p"]) == (0.35, 0.85)
    assert "top_k" not in _sent(ui)  # (the model's top_k applies on the server)
    page.locator("#temperature").evaluate("(el) => { el.value = '0.5'; el.dispatchEvent(new Event('input')); }")
    expect(page.locator("#temperature-out")).to_have_text("0.50")
    ui.send("again")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    assert (_sent(ui)["temperature"], _sent(ui)["top_p"]) == (0.5, 0.85)
    page.reload()  # (kept: the chat's own temperature, the model's top_p)
    ui.wait_connected()
    expect(page.locator("#temperature-out")).to_have_text("0.50")
    expect(page.locator("#top_p-out")).to_have_text("0.85 · default")


def test_a_model_without_defaults_gets_the_uis(ui: UI) -> None:
    ui.open()
    expect(ui.page.locator("#temperature-out")).to_have_text("0.70 · default")
    ui.setting("max_tokens", 2)
    ui.send("hi")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    assert (_sent(ui)["temperature"], _sent(ui)["top_p"]) == (0.7, 1.0)
