"""Conversations in the browser against a real `sluice serve`: streaming render, several chats on
one socket, stop, regenerate, persistence across reloads, and chat management (web/chats.js, web/view.js)."""
from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.web.common import LONG, STREAMING, count_growth, longer_than


def test_enter_sends_answer_streams_in_steps_and_footer_shows_stats(ui):
    page = ui.page
    ui.open()
    ui.setting("seed", 7)
    ui.setting("max_tokens", LONG)  # thousands of steps: several renders however fast the model or slow the browser
    page.fill("#prompt", "line one")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    expect(page.locator("#transcript .msg")).to_have_count(0)  # Shift+Enter only made a newline

    count_growth(page)
    page.press("#prompt", "Enter")
    expect(page.locator("#prompt")).to_have_value("")
    assert page.locator("#transcript .msg.user .body").text_content() == "line one\nline two"

    answer = ui.last_answer()
    expect(answer).to_have_attribute("data-status", "done", timeout=400_000)  # (LONG tokens: ~15 s here)
    expect(answer).to_have_attribute("aria-busy", "false")
    busy = page.evaluate("window.__busy")
    assert "true" in busy[:-1], f"the answer should be aria-busy while it grows, saw {busy}"

    chat_id = ui.last_chat_id()
    growth = page.evaluate("window.__growth")
    assert len(ui.frames("delta", chat_id)) >= 3, "the server should stream several deltas"
    assert len(growth) >= 3, f"the answer should grow in several visible steps, saw {len(growth)}"
    assert growth[-1] == answer.locator(".body").text_content()

    done = ui.frames("done", chat_id)[0]
    meta = answer.locator("footer.meta")
    expect(meta.locator('[data-stat="ttft"]')).to_have_text(re.compile(r"TTFT\s*[\d,.]+ ms"))
    expect(meta.locator('[data-stat="tps"]')).to_have_text(re.compile(r"^[\d,.]+ tok/s$"))
    expect(meta.locator('[data-stat="prompt"]')).to_have_text(f"{done['usage']['prompt_tokens']:,} prompt")
    expect(meta.locator('[data-stat="cached"]')).to_have_text(f"{done['usage']['cached_tokens']:,} cached")
    expect(meta.locator('[data-stat="finish"]')).to_have_text(done["finish_reason"])
    assert done["finish_reason"] in ("stop", "length")

    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    answer.locator('[data-action="copy"]').click()
    expect(page.locator("#toast")).to_have_text("Copied to the clipboard")
    assert page.evaluate("navigator.clipboard.readText()") == "".join(
        f["text"] for f in ui.frames("delta", chat_id))  # the raw answer text, exactly as streamed


def test_two_chats_stream_at_once_over_one_socket_and_switch_while_streaming(ui):
    page = ui.page
    ui.open()
    ui.setting("seed", 1)
    ui.setting("max_tokens", LONG)
    ui.send("first conversation")
    expect(ui.last_answer()).to_have_attribute("data-status", "streaming")
    first_id = ui.last_chat_id()

    page.click("#new-chat")  # a new chat inherits the current chat's settings
    ui.send("second conversation")
    expect(ui.last_answer()).to_have_attribute("data-status", "streaming")
    second_id = ui.last_chat_id()
    expect(page.locator(".chat-item[data-live]")).to_have_count(2)

    # Back to the first chat while both stream: its answer keeps growing on screen.
    page.locator(".chat-item", has_text="first conversation").locator(".chat-open").click()
    body = ui.last_answer().locator(".body")
    expect(ui.last_answer()).to_have_attribute("data-status", "streaming")
    expect(body).to_have_text(longer_than(len(body.text_content())))

    assert len(ui.sockets) == 1, "every chat must share the page's single WebSocket"
    assert {f["id"] for f in ui.sent if f["type"] == "chat"} == {first_id, second_id}
    assert ui.frames("delta", first_id) and ui.frames("delta", second_id)
    assert not ui.frames("done", first_id) and not ui.frames("done", second_id)

    page.click("#send")  # Stop the first...
    expect(ui.last_answer()).to_have_attribute("data-status", "cancelled")
    page.locator(".chat-item", has_text="second conversation").locator(".chat-open").click()
    page.click("#send")  # ...and the second
    expect(ui.last_answer()).to_have_attribute("data-status", "cancelled")
    expect(page.locator(".chat-item[data-live]")).to_have_count(0)
    assert len(ui.sockets) == 1


def test_stop_mid_stream_ends_the_answer_as_cancelled(ui):
    page = ui.page
    ui.open()
    ui.setting("seed", 1)  # answers in this suite never end early by sampling end-of-text (conftest.py)
    ui.setting("max_tokens", LONG)
    ui.send("a long answer, please")
    answer = ui.last_answer()
    expect(answer).to_have_attribute("data-status", "streaming")
    expect(answer.locator(".body")).to_have_text(longer_than(10))
    stop = page.locator("#send")
    expect(stop).to_have_attribute("aria-label", "Stop answer")
    stop.click()
    expect(answer).to_have_attribute("data-status", "cancelled")
    expect(answer.locator('[data-stat="finish"]')).to_have_text("cancelled")
    assert [f["type"] for f in ui.sent if f.get("id") == ui.last_chat_id()] == ["chat", "cancel"]
    assert ui.frames("done", ui.last_chat_id())[0]["finish_reason"] == "cancelled"
    expect(stop).to_have_attribute("aria-label", "Send message")
    # A cancelled answer can be regenerated.
    answer.locator('[data-action="regenerate"]').click()
    expect(ui.last_answer()).to_have_attribute("data-status", STREAMING)
    page.click("#send")
    expect(ui.last_answer()).to_have_attribute("data-status", "cancelled")


def test_reload_restores_conversations_and_marks_interrupted_answers(ui):
    page = ui.page
    ui.open()
    ui.setting("seed", 3)
    ui.setting("max_tokens", 12)
    ui.send("remember me")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    answer_text = ui.last_answer().locator(".body").text_content()

    page.click("#new-chat")
    ui.send("second conversation")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    item = page.locator(".chat-item", has_text="second conversation")
    item.hover()
    item.locator('[data-action="rename"]').click()
    page.fill(".rename-input", "Renamed chat")
    page.press(".rename-input", "Enter")
    expect(page.locator("#chat-title")).to_have_text("Renamed chat")

    page.click("#new-chat")
    ui.setting("max_tokens", LONG)
    ui.send("cut me off")
    expect(ui.last_answer()).to_have_attribute("data-status", "streaming")

    page.reload()
    ui.wait_connected()
    titles = page.locator(".chat-item .chat-title").all_text_contents()
    assert titles == ["cut me off", "Renamed chat", "remember me"]
    expect(ui.last_answer()).to_have_attribute("data-status", "cut")  # streaming when the page went away
    expect(ui.last_answer().locator('[data-stat="finish"]')).to_have_text("cut off")
    expect(page.locator("#max_tokens")).to_have_value(str(LONG))

    page.locator(".chat-item", has_text="remember me").locator(".chat-open").click()
    expect(page.locator("#transcript .msg.user .body")).to_have_text("remember me")
    assert ui.last_answer().locator(".body").text_content() == answer_text
    expect(ui.last_answer().locator('[data-stat="ttft"]')).to_be_visible()


def test_new_rename_delete_and_undo(ui):
    page = ui.page
    ui.open()
    page.click("#new-chat")
    page.click("#new-chat")
    items = page.locator(".chat-item")
    expect(items).to_have_count(3)
    first = items.first
    first.hover()
    first.locator('[data-action="rename"]').click()
    page.fill(".rename-input", "Groceries")
    page.press(".rename-input", "Enter")
    expect(first.locator(".chat-title")).to_have_text("Groceries")
    first.hover()
    first.locator('[data-action="rename"]').click()
    page.fill(".rename-input", "Discarded name")
    page.press(".rename-input", "Escape")
    expect(first.locator(".chat-title")).to_have_text("Groceries")

    first.hover()
    first.get_by_role("button", name="Delete “Groceries”").click()
    expect(items).to_have_count(2)
    expect(page.locator("#toast")).to_contain_text("Deleted “Groceries”")
    page.locator("#toast").get_by_role("button", name="Undo").click()
    expect(items).to_have_count(3)
    expect(page.locator("#chat-title")).to_have_text("Groceries")
    for _ in range(50):  # saves are debounced (300 ms): wait for the undo to reach storage
        if "Groceries" in (page.evaluate("localStorage.getItem('sluice.chats.v1')") or ""):
            break
        page.wait_for_timeout(100)
    assert "Groceries" in page.evaluate("localStorage.getItem('sluice.chats.v1')")
