"""Loop-side request state (service/handle.py): merging for slow readers, one finish, token rate."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.handle import RequestError, RequestHandle, TokenRate


@given(st.lists(st.tuples(st.text(max_size=5), st.integers(0, 3)), max_size=30), st.data())
def test_takes_merge_to_exactly_what_was_pushed(pushes: list[tuple[str, int]], data: st.DataObject) -> None:
    h = RequestHandle("r", "ws", lambda: None)
    taken_text, taken_tokens = [], 0
    for text, n in pushes:
        h.push(text, n, [(text, -1.0, [])] if n else None)
        if data.draw(st.booleans()):  # the reader keeps up sometimes, and sometimes lags
            t, k, _ = h.take()
            taken_text.append(t)
            taken_tokens += k
    t, k, _ = h.take()
    assert "".join(taken_text) + t == "".join(text for text, _ in pushes)
    assert taken_tokens + k == h.completion_tokens == sum(n for _, n in pushes)
    assert h.take() == ("", 0, [])


def test_slow_reader_gets_one_merged_take() -> None:
    h = RequestHandle("r", "ws", lambda: None)
    for word in ["a", "b", "c"]:
        h.push(word, 1, [(word, -0.5, [(word, -0.5)])])
    text, tokens, lps = h.take()
    assert (text, tokens, [t for t, _, _ in lps]) == ("abc", 3, ["a", "b", "c"])


def test_finishes_exactly_once() -> None:
    h = RequestHandle("r", "ws", lambda: None)
    assert not h.finished and h.timing_ms()[1] is None
    h.finish(None, RequestError("internal", "boom"))
    assert h.finished and h.error is not None and h.error.code == "internal"
    with pytest.raises(AssertionError):
        h.finish("stop", None)


def test_token_rate() -> None:
    rate = TokenRate(window_s=5.0)
    assert rate.per_s(0.0) == 0.0
    for t in range(10):
        rate.add(float(t), 100 * t)
    assert rate.per_s(9.0) == pytest.approx(100.0)
    assert rate.per_s(100.0) == 0.0  # idle for longer than the window
