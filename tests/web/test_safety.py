"""Injection safety of the chat UI: user text and model text reach the DOM as text nodes only.

The tiny model's output cannot be steered, so model-side HTML is injected two ways: by rewriting
the real server's `delta` frames in flight (Playwright's WebSocket routing), and by calling the
page's own `renderText` (web/render.js) on hostile strings.
"""
from __future__ import annotations

import json
import re

from playwright.sync_api import expect

IMG = '<img src=x onerror="window.__xss=1">'
SCRIPT = "<script>window.__xss=2</script>"
HOSTILE = f'{IMG} <b>bold</b> `{SCRIPT}`\n\n```html\n{SCRIPT}\n{IMG}\n```\n<svg onload="window.__xss=3"></svg>\n\n'
ALLOWED_TAGS = {"P", "CODE", "FIGURE", "FIGCAPTION", "SPAN", "BUTTON", "PRE"}


def assert_no_markup(page) -> None:
    bodies = page.locator("#transcript .body")
    assert bodies.count() > 0
    assert bodies.locator("img, script, svg, b, iframe").count() == 0
    assert page.evaluate("window.__xss") is None


def test_html_in_a_user_message_is_shown_literally(ui):
    page = ui.page
    ui.open()
    ui.setting("max_tokens", 8)
    ui.send(IMG)
    user = page.locator("#transcript .msg.user .body")
    expect(user).to_have_count(1)
    assert user.text_content() == IMG
    expect(page.locator("#chat-title")).to_have_text(IMG)
    expect(page.locator(".chat-item .chat-title")).to_have_text(IMG)
    expect(ui.last_answer()).to_have_attribute("data-status", re.compile("done|error"))
    chat = next(f for f in ui.sent if f["type"] == "chat")
    assert chat["messages"][-1] == {"role": "user", "content": IMG}  # sent verbatim, escaped by nobody
    assert_no_markup(page)

    page.reload()  # the persisted copy renders through the same path
    ui.wait_connected()
    assert page.locator("#transcript .msg.user .body").text_content() == IMG
    assert_no_markup(page)


def test_html_in_model_output_is_shown_literally(ui):
    page = ui.page

    def inject(ws):
        server = ws.connect_to_server()
        rewritten: set[str] = set()

        def from_server(message):
            frame = json.loads(message)
            if frame.get("type") == "delta" and frame["id"] not in rewritten:
                rewritten.add(frame["id"])
                frame["text"] = HOSTILE + frame["text"]
                message = json.dumps(frame)
            ws.send(message)

        server.on_message(from_server)
        ws.on_message(lambda message: server.send(message))

    page.route_web_socket(re.compile(r"/v1/ws(\?|$)"), inject)
    ui.open()
    ui.setting("seed", 7)  # a seed whose answer is not empty: the first delta carries the payload
    ui.setting("max_tokens", 12)
    ui.send("say something")
    answer = ui.last_answer()
    expect(answer).to_have_attribute("data-status", re.compile("done"))
    body = answer.locator(".body")
    text = body.text_content()
    assert any(f["type"] == "delta" for f in ui.received), "the model produced no text to carry the payload"
    assert IMG in text and "<b>bold</b>" in text and '<svg onload="window.__xss=3"></svg>' in text
    assert body.locator("p code").first.text_content() == SCRIPT  # inline code span
    assert body.locator("figure.code pre code").text_content() == f"{SCRIPT}\n{IMG}"
    expect(body.locator("figure.code figcaption span")).to_have_text("html")
    page.wait_for_timeout(200)  # give any injected handler a chance to run
    assert_no_markup(page)
    page.reload()
    ui.wait_connected()
    assert IMG in ui.last_answer().locator(".body").text_content()
    assert_no_markup(page)


def test_render_text_builds_only_text_nodes_and_safe_elements(ui):
    page = ui.page
    ui.open()
    result = page.evaluate("""async (input) => {
      const {renderText} = await import('./render.js');
      const host = document.createElement('div');
      host.append(renderText(input));
      document.body.append(host);  // attached, so an injected handler would fire
      await new Promise((r) => setTimeout(r, 100));
      const walker = document.createTreeWalker(host, NodeFilter.SHOW_ALL);
      const kinds = new Set();
      while (walker.nextNode()) kinds.add(walker.currentNode.nodeType);
      const attrs = [...host.querySelectorAll('*')].flatMap((el) => [...el.attributes].map((a) => a.name));
      return {tags: [...new Set([...host.querySelectorAll('*')].map((el) => el.tagName))], kinds: [...kinds],
              attrs: [...new Set(attrs)], text: host.textContent, xss: window.__xss ?? null};
    }""", HOSTILE)
    assert set(result["tags"]) <= ALLOWED_TAGS, result["tags"]
    assert set(result["kinds"]) <= {1, 3}, "elements and text nodes only"
    assert set(result["attrs"]) <= {"class", "type", "data-action", "aria-label", "tabindex"}, result["attrs"]
    assert IMG in result["text"] and SCRIPT in result["text"]
    assert result["xss"] is None
