"""Loop-side request state (service/handle.py): merging for slow readers, one finish, token rate; who a client is."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from starlette.requests import HTTPConnection

from engine import TokenLogprob
from engine.detokenizer import TokenText
from service.handle import RequestError, RequestHandle, TokenRate, TokenScores, client_key, client_of


@pytest.fixture(scope="module")
def names(tiny_model_dir) -> TokenText:
    """The server's: frozen to the model's vocabulary."""
    from engine.processor import InputProcessor

    return InputProcessor(tiny_model_dir, 1024, 512).token_text.freeze(1024)


def _scores(ids: list[int], k: int = 1) -> TokenScores:
    return TokenScores.of([TokenLogprob(t, -0.5 * t, [(t + j, -0.25 * j) for j in range(k)]) for t in ids])


@given(st.lists(st.tuples(st.text(max_size=5), st.integers(0, 3)), max_size=30), st.data())
def test_takes_merge_to_exactly_what_was_pushed(names: TokenText, pushes: list[tuple[str, int]],
                                                data: st.DataObject) -> None:
    h = RequestHandle("r", "ws", lambda: None, names)
    taken_text, taken_tokens, taken_ids = [], 0, []
    for i, (text, n) in enumerate(pushes):
        h.push(text, n, _scores([10 * i + j for j in range(n)]) if n else None)
        if data.draw(st.booleans()):  # the reader keeps up sometimes, and sometimes lags
            t, k, lps = h.take()
            taken_text.append(t)
            taken_tokens += k
            taken_ids += [lp[0] for lp in lps]
    t, k, lps = h.take()
    assert "".join(taken_text) + t == "".join(text for text, _ in pushes)
    assert taken_tokens + k == h.completion_tokens == sum(n for _, n in pushes)
    assert taken_ids + [lp[0] for lp in lps] == [10 * i + j for i, (_, n) in enumerate(pushes) for j in range(n)]
    assert h.take() == ("", 0, [])


def test_slow_reader_gets_one_merged_take(names: TokenText) -> None:
    h = RequestHandle("r", "ws", lambda: None, names)
    for word, t in [("a", 300), ("b", 301), ("c", 302)]:
        h.push(word, 1, _scores([t], k=2))
    text, tokens, lps = h.take()
    assert (text, tokens) == ("abc", 3)
    lazy = TokenText(names.tokenizer)  # (as read one by one)
    assert lps == [(t, lazy.name(t), lazy.bytes(t), -0.5 * t, ((t, lazy.name(t), lazy.bytes(t), 0.0),
                                                               (t + 1, lazy.name(t + 1), lazy.bytes(t + 1), -0.25)))
                   for t in (300, 301, 302)]
    assert all(lp[1] for lp in lps)


def test_an_answers_logprobs_wait_unnamed_in_a_few_arrays(names: TokenText) -> None:
    """A non-streamed answer's logprobs are kept until it ends (and a slow reader's until it reads): as the engine's
    ids and floats, about 12 bytes a token and 12 an alternative, named only when taken. As named tuples they were
    ~4 KB a token with its top 20 (a seat's answer of 32k tokens: 134 MB; every seat's, with `n` choices: gigabytes)."""
    import pickle
    import tracemalloc

    h = RequestHandle("r", "chat", lambda: None, names)
    # (as the engine's pipe brings them)
    steps = [pickle.loads(pickle.dumps(_scores([t % 1000], k=20))) for t in range(2000)]
    tracemalloc.start()
    try:
        for i, scores in enumerate(steps):
            h.push("x", 1, scores)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held / 2000 < 400, f"{held / 2000:.0f} bytes a token held"
    _, _, lps = h.take()
    assert len(lps) == 2000 and lps[-1][:2] == (999, names.name(999)) and len(lps[-1][4]) == 20


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
    ("64:ff9b::c000:207", "192.0.2.7"), ("64:ff9b::c000:208", "192.0.2.8"),  # translated by NAT64: the same
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
