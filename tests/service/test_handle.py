"""Loop-side request state (service/handle.py): merging for slow readers, one finish, token rate; who a client is."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from starlette.requests import HTTPConnection

from service.handle import RequestError, RequestHandle, TokenRate, client_key, client_of


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


def test_prompt_scores_travel_flat_and_name_every_token(tiny_model_dir) -> None:
    """A prompt's logprobs cross from the engine as a few flat arrays (not a million objects to pickle, unpickle and
    have the cyclic collector scan), and name back to each token's logprob, rank and alternatives."""
    import pickle
    from array import array

    from engine import PromptLogprob
    from engine.processor import InputProcessor
    from service.handle import PromptScores

    ids = list(range(40, 440))
    lps = [None] + [PromptLogprob(t, -0.5 * j, j, [(t + 1, -0.1), (t + 2, -0.2)]) for j, t in enumerate(ids[1:], 1)]
    scores = pickle.loads(pickle.dumps(PromptScores.of(ids, lps)))
    assert all(isinstance(x, array) for x in scores[1:])  # (five objects, whatever the prompt's length)
    named = scores.named(InputProcessor(tiny_model_dir, 1024, 512).token_text)
    assert [n[0] for n in named] == ids and named[0][3:6] == (None, None, [])
    assert [(n[3], n[4], [a[0] for a in n[5]], [a[3] for a in n[5]]) for n in named[1:]] == [
        (lp.logprob, lp.rank, [t for t, _ in lp.top], [v for _, v in lp.top]) for lp in lps[1:]]
    assert [n[3] for n in PromptScores.of(ids, None).named(InputProcessor(tiny_model_dir, 1024, 512).token_text)] == \
        [None] * len(ids)


@pytest.mark.parametrize("pieces, watched", [
    (["<think>I", " add", " two", "</", "think", ">It"], 6),  # (the push that completes it counts)
    (list("ab</think>c"), 10),  # one character a push
    (["x</think>"], 1),
    (["</thi", "nk>", "</think>"], 2),  # (its first appearance)
    (["<think>", "no end"], None),
])
def test_a_watched_text_counts_the_tokens_up_to_its_end(pieces, watched) -> None:
    """`RequestHandle.watch`: a reasoning's reasoning tokens are those up to the end of its closing tag, however the
    pushes split it."""
    h = RequestHandle("r", "chat", lambda: None)
    h.watch("</think>")
    for piece in pieces:
        h.push(piece, 1, None)
    assert h.watched == watched


@pytest.mark.parametrize(("host", "client"), [
    ("2a00:1450:4001:81b::200e", "2a00:1450:4001:81b::/64"),  # an internet IPv6 address: its /64
    ("2A00:1450:4001:81B:1:2:3:4", "2a00:1450:4001:81b::/64"),  # (another of the same /64, written otherwise)
    ("2a00:1450:4001:81c::1", "2a00:1450:4001:81c::/64"),
    ("::ffff:192.0.2.7", "192.0.2.7"),  # IPv4 on a dual-stack socket: the IPv4 address
    ("192.0.2.7", "192.0.2.7"),
    ("::1", "::1"), ("fe80::1", "fe80::1"), ("fd12:3456:789a:1::5", "fd12:3456:789a:1::5"),  # a LAN's: itself
    ("-", "-"), ("proxy.internal", "proxy.internal"),  # not an address: as given
])
def test_a_client_is_its_address_and_internet_ipv6_its_64(host: str, client: str) -> None:
    assert client_key(host) == client
    scope = {"type": "http", "client": (host, 4321), "headers": []}
    assert client_of(HTTPConnection(scope)) == client


def test_without_a_peer_the_client_is_a_dash() -> None:
    assert client_of(HTTPConnection({"type": "http", "client": None, "headers": []})) == "-"
