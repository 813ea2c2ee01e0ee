"""Fixtures for the browser UI tests: a real `python -m service` (embedded tiny model) on a free
loopback port, and Debian's Chromium driven by Playwright. Without /usr/bin/chromium the tests skip,
except under CI=true, where a missing browser is a failure."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.web.common import KEY, UI, open_ui

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("SLUICE_ARTIFACTS", REPO / "tmp" / "artifacts"))
STARTUP_TIMEOUT_S = 180
EXPECT_TIMEOUT_MS = 30_000  # answers stream at a few tokens/s on a busy 2-core CI machine


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _spawn(tmp: Path, *extra: str) -> Server:
    port = _free_port()
    log = tmp / f"serve-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(port), *extra],
                            cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return Server(f"http://127.0.0.1:{port}", proc, log)


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"`python -m service` exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


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
def servers(browser, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """Two `sluice serve` processes on the embedded tiny model (random weights: its text is gibberish
    by design), one open and one with `--api-key`; started side by side to halve the wait."""
    tmp = tmp_path_factory.mktemp("serve")
    procs = {"open": _spawn(tmp), "keyed": _spawn(tmp, "--api-key", KEY)}
    try:
        for srv in procs.values():
            _wait_healthy(srv)
        yield procs
    finally:
        for srv in procs.values():
            srv.proc.terminate()
        for srv in procs.values():
            try:
                srv.proc.wait(10)
            except subprocess.TimeoutExpired:
                srv.proc.kill()
                srv.proc.wait()


@pytest.fixture(scope="session")
def server(servers) -> Server:
    return servers["open"]


@pytest.fixture(scope="session")
def keyed_server(servers) -> Server:
    return servers["keyed"]


@pytest.fixture
def ui(browser, server) -> Iterator[UI]:
    """A page on the real server. Any console error or uncaught exception fails the test."""
    with open_ui(browser, server.url) as page_ui:
        yield page_ui
        errors = list(page_ui.errors)
    assert not errors, "console errors:\n" + "\n".join(errors)


@pytest.fixture
def keyed_ui(browser, keyed_server) -> Iterator[UI]:
    """A page on a server started with `--api-key KEY`."""
    with open_ui(browser, keyed_server.url) as page_ui:
        yield page_ui
        errors = list(page_ui.errors)
    assert not errors, "console errors:\n" + "\n".join(errors)


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
