"""The UI served over https (`--ssl-certfile`/`--ssl-keyfile`) opens its WebSocket on wss:// (web/app.js follows the
page's scheme; a page on https may not open ws://) and chats over it."""
from __future__ import annotations

import ssl
from collections.abc import Iterator

import pytest
import trustme
from playwright.sync_api import expect

from tests.server import Server, spawn_server, wait_healthy
from tests.web.common import UI, open_ui


@pytest.fixture(scope="module")
def tls_server(browser, tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tls-ui")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    client = ssl.create_default_context()
    ca.configure_trust(client)
    srv = spawn_server(tmp, "--model", str(tiny_model_dir), "--ssl-keyfile", str(tmp / "key.pem"),
                       "--ssl-certfile", str(tmp / "cert.pem"), tls=client)
    try:
        yield wait_healthy(srv)
    finally:
        srv.stop()


@pytest.fixture
def tls_ui(browser, tls_server: Server) -> Iterator[UI]:
    # (the throwaway CA is not the browser's: its certificate is taken as it is)
    with open_ui(browser, tls_server.url, ignore_https_errors=True) as ui:
        yield ui
        errors = list(ui.errors)
    assert not errors, "console errors:\n" + "\n".join(errors)


def test_the_ui_chats_over_wss(tls_ui: UI, tls_server: Server) -> None:
    ui = tls_ui
    assert ui.base_url.startswith("https://")
    ui.open()
    ui.setting("max_tokens", 4)
    ui.send("hello over TLS")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    assert ui.frames("done", ui.last_chat_id())
    urls = [ws.url for ws in ui.sockets]
    assert urls and all(url.startswith(f"wss://127.0.0.1:{tls_server.port}/v1/ws") for url in urls), urls
