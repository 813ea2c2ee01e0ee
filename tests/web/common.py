"""Helpers shared by the browser tests: a page wrapper that records console errors and WebSocket
frames, and matchers that need no `eval` (the page's CSP forbids it, so no wait_for_function)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

KEY = "test-key-123"  # the keyed test server's --api-key
LONG = 3600  # max_tokens for answers that must still be streaming when the test acts on them (the tiny model has 4,096 positions; a token took ~3.5 ms here)
STREAMING = re.compile(r"^(pending|streaming)$")


def longer_than(n: int) -> re.Pattern[str]:
    """Matches text of more than n characters (the page's CSP forbids wait_for_function's eval)."""
    return re.compile(r"[\s\S]{%d}" % (n + 1))


def count_growth(page) -> None:
    """Record every distinct text the newest answer shows while it streams (in window.__growth), and
    its aria-busy at each of those moments (window.__busy): no race with how fast the answer ends."""
    page.evaluate("""() => {
      window.__growth = [];
      window.__busy = [];
      const t = document.getElementById('transcript');
      new MutationObserver(() => {
        const answers = t.querySelectorAll('.msg.assistant');
        const last = answers.length ? answers[answers.length - 1] : null;
        const text = last ? last.querySelector('.body').textContent : '';
        if (text && text !== window.__growth.at(-1)) {
          window.__growth.push(text);
          window.__busy.push(last.getAttribute('aria-busy'));
        }
      }).observe(t, {childList: true, subtree: true, characterData: true});
    }""")


CONTRAST_JS = """(selectors) => {
  const rgba = (c) => {  // 'rgb(…)', 'rgba(…)' or 'color(srgb r g b / a)' → [r, g, b, a] in 0..255, alpha 0..1
    const n = c.match(/[\\d.]+/g).map(Number);
    const rgb = c.startsWith('color(') ? n.slice(0, 3).map((v) => v * 255) : n.slice(0, 3);
    return [...rgb, n.length > 3 ? n[3] : 1];
  };
  const lum = (c) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
  };
  const background = (el) => {
    for (; el; el = el.parentElement) {
      const c = rgba(getComputedStyle(el).backgroundColor);
      if (c[3] > 0) return c;
    }
    return rgba(getComputedStyle(document.documentElement).backgroundColor);
  };
  const out = [];
  for (const sel of selectors) {
    for (const el of document.querySelectorAll(sel)) {
      if (!el.getClientRects().length || !el.textContent.trim()) continue;
      const [a, b] = [lum(rgba(getComputedStyle(el).color)), lum(background(el))];
      out.push({sel, ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)});
      break;
    }
  }
  return out;
}"""
TEXT_SELECTORS = [
    ".chat-title", ".chat-sub", "#chat-title", ".preset-badge", ".msg.assistant .body p", ".msg.user .body p",
    ".chip b", ".chip-label", ".badge", ".note", ".card h2", ".card label", ".stats dt", ".stats dd",
    ".model-sub", ".composer-hint", ".btn.primary", "#conn-text", "figure.code pre", "figure.code figcaption span",
    ".code-copy", ".spark-head", ".field output",
]


@dataclass
class UI:
    """A page plus what the test must be able to assert on: console errors and WebSockets opened."""
    page: object
    base_url: str
    errors: list[str] = field(default_factory=list)
    sockets: list[object] = field(default_factory=list)
    sent: list[dict] = field(default_factory=list)
    received: list[dict] = field(default_factory=list)

    def open(self) -> None:
        self.page.goto(self.base_url + "/")
        self.wait_connected()

    def wait_connected(self) -> None:
        self.page.wait_for_selector('#conn[data-state="ready"]', timeout=20_000)

    def setting(self, name: str, value: object) -> None:
        self.page.fill(f"#{name}", str(value))

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def last_answer(self):
        return self.page.locator("#transcript .msg.assistant").last

    def frames(self, kind: str, chat_id: str | None = None) -> list[dict]:
        return [f for f in self.received if f.get("type") == kind and (chat_id is None or f.get("id") == chat_id)]

    def contrast(self) -> dict[str, float]:
        """WCAG contrast ratio of the first visible element of each text style against its background."""
        return {r["sel"]: round(r["ratio"], 2) for r in self.page.evaluate(CONTRAST_JS, TEXT_SELECTORS)}

    def last_chat_id(self) -> str:
        return [f for f in self.sent if f["type"] == "chat"][-1]["id"]


def _watch(ui: UI) -> None:
    page = ui.page

    def on_console(msg) -> None:
        if msg.type == "error":
            ui.errors.append(f"console: {msg.text}")

    def on_socket(ws) -> None:
        ui.sockets.append(ws)
        ws.on("framesent", lambda payload: ui.sent.append(json.loads(payload)))
        ws.on("framereceived", lambda payload: ui.received.append(json.loads(payload)))

    page.on("console", on_console)
    page.on("pageerror", lambda exc: ui.errors.append(f"pageerror: {exc}"))
    page.on("websocket", on_socket)


@contextmanager
def open_ui(browser, url: str, **context_args) -> Iterator[UI]:
    """A fresh browser context (empty storage) with console errors and WebSockets recorded."""
    context = browser.new_context(viewport={"width": 1366, "height": 860}, **context_args)
    context.set_default_timeout(20_000)
    try:
        ui = UI(context.new_page(), url)
        _watch(ui)
        yield ui
    finally:
        context.close()
