"""Fixtures for the browser UI tests: a real `python -m service` (the embedded tiny model, end-of-text made
unreachable: `no_eos_model_dir`) on a free loopback port, and Debian's Chromium driven by Playwright. Without /usr/bin/chromium the tests skip,
except under CI=true, where a missing browser is a failure.

NOTE: Playwright's sync API keeps an event loop running in the main thread while the browser is open,
so async tests cannot run after these in one session; pytest's path order puts tests/web last.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.server import REPO, Server, spawn_server, wait_healthy
from tests.web.common import KEY, UI, open_ui

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("SLUICE_ARTIFACTS", REPO / "tmp" / "artifacts"))
EXPECT_TIMEOUT_MS = 30_000  # answers stream at a few tokens/s on a busy 2-core CI machine


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser():
    if not os.path.exists(CHROMIUM):
        _unavailable(f"{CHROMIUM} is missing: install Debian's browser with `apt-get install -y chromium`")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _unavailable("the `playwright` Python package is not installed (pip install playwright)")
    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def no_eos_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model with its end-of-text row of the LM head zeroed: that logit is always 0 while the
    largest of the others is ~+9, so a greedy answer never ends by end-of-text and a sampled one (temperature
    0.7) ends so with a chance of ~1e-7 a token. Tests that act on a streaming answer then hold by construction,
    whatever the speed of the machine (answers of the unchanged model sampled it within a few hundred tokens)."""
    out = tmp_path_factory.mktemp("model") / tiny_model_dir.name  # the same name: the UI shows the same model
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    weights["lm_head.weight"][eos if isinstance(eos, list) else [eos]] = 0.0
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def servers(browser, no_eos_model_dir: Path, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """Two `sluice serve` processes on the tiny model (random weights: its text is gibberish by design), one open
    and one with `--api-key`; started side by side to halve the wait."""
    tmp = tmp_path_factory.mktemp("serve")
    model = ["--model", str(no_eos_model_dir)]
    procs = {"open": spawn_server(tmp, *model), "keyed": spawn_server(tmp, *model, "--api-key", KEY)}
    try:
        for srv in procs.values():
            wait_healthy(srv)
        yield procs
    finally:
        for srv in procs.values():
            srv.stop()


@pytest.fixture(scope="session")
def server(servers) -> Server:
    return servers["open"]


@pytest.fixture(scope="session")
def keyed_server(servers) -> Server:
    return servers["keyed"]


def _checked_page(browser, url: str) -> Iterator[UI]:
    """A page on `url`. Any console error or uncaught exception fails the test."""
    with open_ui(browser, url) as page_ui:
        yield page_ui
        errors = list(page_ui.errors)
    assert not errors, "console errors:\n" + "\n".join(errors)


@pytest.fixture
def ui(browser, server) -> Iterator[UI]:
    """A page on the real server."""
    yield from _checked_page(browser, server.url)


@pytest.fixture
def keyed_ui(browser, keyed_server) -> Iterator[UI]:
    """A page on a server started with `--api-key KEY`."""
    yield from _checked_page(browser, keyed_server.url)


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
