"""The embedded default model (engine/sluice-chat, trained by engine/train.py) behind the real UI: a question
about Python gets an answer in words of the documentation it learnt from, not gibberish. `SLUICE_UPDATE_DOCS=1`
refreshes README's screenshot (docs/ui.png) from this page."""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.server import Server, spawn_server, wait_healthy
from tests.web.conftest import _checked_page

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def default_server(browser, tmp_path_factory) -> Iterator[Server]:
    srv = wait_healthy(spawn_server(tmp_path_factory.mktemp("serve"), "--speculative", "ngram", tiny=False))
    try:
        yield srv
    finally:
        srv.stop()


def _doc_words() -> set[str]:
    import pydoc_data.topics

    return {w.lower() for text in pydoc_data.topics.topics.values() for w in re.findall(r"[A-Za-z]+", text)}


def readable_share(text: str, vocabulary: set[str]) -> float:
    """The share of the words of `text` that are words of Python's documentation (random weights score ~0)."""
    words = re.findall(r"[A-Za-z]+", text)
    return sum(w.lower() in vocabulary for w in words) / max(1, len(words))


def test_default_model_answers_in_readable_text(browser, default_server, artifacts):
    vocabulary = _doc_words()
    for page_ui in _checked_page(browser, default_server.url):
        page = page_ui.page
        page_ui.open()
        expect(page.locator("#model-name")).to_contain_text("sluice-chat")
        page.select_option("#preset", "none")
        page.fill("#max_tokens", "160")
        page.locator("#temperature").evaluate("(el) => { el.value = '0'; el.dispatchEvent(new Event('input')); }")
        page_ui.send("Quote this back to me exactly:\n\nThe suite is executed once for each item provided by the iterator.")
        expect(page_ui.last_answer()).to_have_attribute("data-status", "done", timeout=200_000)
        page.click("#new-chat")
        page.select_option("#preset", "none")
        page_ui.send('How does the "for" statement work?')  # the screenshot's chat
        expect(page_ui.last_answer()).to_have_attribute("data-status", "done", timeout=200_000)
        texts = [f["text"] for f in page_ui.received if f.get("type") == "delta"]
        text = "".join(texts)
        assert len(re.findall(r"[A-Za-z]+", text)) >= 20, text
        assert readable_share(text, vocabulary) >= 0.8, text
        page.mouse.move(0, 0)
        shot = artifacts / "ui-default-model.png"
        page.screenshot(path=str(shot))
        if os.environ.get("SLUICE_UPDATE_DOCS"):  # refresh the README screenshot on purpose only
            shutil.copyfile(shot, DOCS / "ui.png")


def test_readable_share_tells_text_from_gibberish():
    vocabulary = _doc_words()
    assert readable_share("The for statement is used to iterate over the elements of a sequence.", vocabulary) == 1.0
    assert readable_share("Vobaku zethi quorpal dinsh mevalo trazuk.", vocabulary) < 0.2
