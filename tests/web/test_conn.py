"""The page's single WebSocket (web/conn.js): a dropped socket cuts streaming answers off and is
reconnected with backoff; a keyed server gets its key through the dialog and `hello`."""
from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.web.common import KEY, LONG, STREAMING


def test_dropped_socket_marks_streaming_chats_cut_off_then_reconnects(ui):
    page = ui.page
    routes, held = [], []

    def forward(ws):
        if routes:  # the reconnect: held (open to the page, no server yet) until the test has seen it waiting
            held.append(ws)
            return
        routes.append((ws, ws.connect_to_server()))

    page.route_web_socket(re.compile(r"/v1/ws(\?|$)"), forward)
    ui.open()
    ui.setting("seed", 1)
    ui.setting("max_tokens", LONG)
    ui.send("this answer will be cut")
    answer = ui.last_answer()
    expect(answer).to_have_attribute("data-status", "streaming")

    ws, server = routes[0]
    ws.close(code=1001, reason="test drops the connection")
    server.close()
    expect(answer).to_have_attribute("data-status", "cut")
    expect(answer.locator('[data-stat="finish"]')).to_have_text("cut off")
    expect(page.locator("#conn")).to_have_attribute("data-state", re.compile("waiting|connecting"))
    expect(page.locator("#conn-text")).to_contain_text(re.compile("retrying|Connecting"))
    expect(page.locator("#conn")).to_have_attribute("data-state", "connecting", timeout=60_000)  # backoff, then held
    ws = held[0]
    routes.append((ws, ws.connect_to_server()))  # the server says `ready` (no key asked)
    ui.wait_connected()
    assert len(routes) == 2 and len(held) == 1
    answer.locator('[data-action="regenerate"]').click()
    expect(ui.last_answer()).to_have_attribute("data-status", STREAMING)
    page.click("#send")
    expect(ui.last_answer()).to_have_attribute("data-status", "cancelled")


def test_api_key_is_asked_for_and_sent_with_hello(keyed_ui):
    ui, page = keyed_ui, keyed_ui.page
    page.goto(ui.base_url + "/")
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#conn")).to_have_attribute("data-state", "auth")
    expect(page.locator("#api-key")).to_be_focused()
    page.fill("#api-key", "wrong-key")
    page.press("#api-key", "Enter")
    expect(page.locator("#key-message")).to_contain_text("did not accept")
    expect(dialog).to_be_visible()
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")
    ui.wait_connected()
    expect(dialog).to_be_hidden()
    assert {"type": "hello", "api_key": KEY} in ui.sent
    assert page.evaluate("sessionStorage.getItem('sluice.apiKey')") == KEY
    assert page.evaluate("localStorage.getItem('sluice.apiKey')") is None  # remembered only if asked

    ui.setting("max_tokens", 6)
    ui.send("hello with a key")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    page.reload()  # the tab's key is sent as `hello` without asking again
    ui.wait_connected()
    expect(dialog).to_be_hidden()


def test_the_socket_carries_one_routing_key_per_browser(ui):
    """`?route=` (README "Scaling"): a load balancer keeps a browser's chats on the replica that caches them, so
    the key is random per browser and the same after a reload."""
    ui.open()
    ui.page.reload()
    ui.wait_connected()
    keys = [re.search(r"[?&]route=([0-9a-f]+)$", ws.url) for ws in ui.sockets]
    assert len(keys) == 2 and all(keys), [ws.url for ws in ui.sockets]
    assert keys[0].group(1) == keys[1].group(1) and len(keys[0].group(1)) == 16
    assert ui.page.evaluate("localStorage.getItem('sluice.route')") == keys[0].group(1)
