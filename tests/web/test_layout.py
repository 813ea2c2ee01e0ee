"""Accessibility basics (names, live regions, focus, contrast in both themes), responsive layout and
screenshots (web/index.html, web/style.css)."""
from __future__ import annotations


from playwright.sync_api import expect

from tests.web.common import LONG



def assert_readable(ui) -> None:
    """Every text style on screen meets WCAG AA contrast (4.5:1) against its background."""
    ratios = ui.contrast()
    assert len(ratios) >= 15, f"too few text styles found to judge: {ratios}"
    assert {sel: r for sel, r in ratios.items() if r < 4.5} == {}


def test_controls_are_labelled_and_streaming_is_announced(ui):
    page = ui.page
    ui.open()
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea')]
      .filter((el) => !(el.getAttribute('aria-label') || [...(el.labels || [])].some((l) => l.textContent.trim())
                        || el.textContent.trim()))
      .map((el) => el.outerHTML.slice(0, 120))""")
    assert unnamed == []
    log = page.locator("#transcript")
    expect(log).to_have_attribute("role", "log")
    expect(log).to_have_attribute("aria-live", "polite")
    expect(page.locator("#conn-text")).to_have_attribute("aria-live", "polite")  # connection state
    page.keyboard.press("Tab")  # the first stop is the skip link, and it leads to the message box
    expect(page.locator(".skip-link")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("#prompt")).to_be_focused()


def test_screenshots_desktop_and_phone(ui, artifacts):
    page = ui.page
    ui.open()
    ui.setting("seed", 11)
    ui.setting("max_tokens", 16)
    ui.send("Explain prefix caching in one paragraph.")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    page.click("#new-chat")  # same preset → same system prompt → a cached shared prefix
    ui.send("Write a haiku about rivers.")
    answer = ui.last_answer()
    expect(answer).to_have_attribute("data-status", "done")
    cached = ui.frames("done", ui.last_chat_id())[0]["usage"]["cached_tokens"]
    assert cached > 0, "a second chat with the same preset should reuse the system prompt's cached prefix"
    ui.send("Now one about the sea, with a code block:\n```python\nprint('waves')\n```")
    expect(ui.last_answer()).to_have_attribute("data-status", "done")
    expect(page.locator("#shared-note")).to_contain_text("Shared with 1 other chat")

    page.click("#new-chat")
    page.select_option("#preset", "terse")
    ui.setting("max_tokens", LONG)
    ui.send("Stream something long while I look around.")
    expect(ui.last_answer()).to_have_attribute("data-status", "streaming")
    page.locator(".chat-item", has_text="haiku").locator(".chat-open").click()
    expect(page.locator("#st-running")).not_to_have_text("—", timeout=5_000)
    page.wait_for_timeout(2_500)  # let the sparkline collect a few samples
    page.mouse.move(0, 0)

    desktop = artifacts / "ui-desktop.png"
    page.screenshot(path=str(desktop))  # README's (docs/ui.png) is tests/web/test_default_model.py's: real text
    assert_readable(ui)
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=str(artifacts / "ui-desktop-dark.png"))
    assert_readable(ui)
    page.emulate_media(color_scheme="light")

    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390, "no horizontal scrolling on a phone"
    expect(page.locator("#open-sidebar")).to_be_visible()
    expect(page.locator("#sidebar")).not_to_be_visible()
    page.screenshot(path=str(artifacts / "ui-phone.png"))
    page.click("#open-sidebar")
    expect(page.locator("#sidebar")).to_be_visible()
    page.wait_for_timeout(300)  # drawer transition
    page.screenshot(path=str(artifacts / "ui-phone-chats.png"))
    page.keyboard.press("Escape")
    expect(page.locator("#sidebar")).not_to_be_visible()
