"""IncrementalDetokenizer on the tiny model's byte-level BPE tokenizer: deltas add up to the full decode,
never split a UTF-8 character, and never show any part of a matched stop string; plus stop strings end to end.
Every test runs twice: decoding with the tokenizer's DecodeStream, and in Python (slow tokenizers, or a stream
that gave up). Then the two side by side on random ids, also for a SentencePiece-style tokenizer."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import engine.detokenizer
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.detokenizer import _BYTE_OF, IncrementalDetokenizer

PROMPT = "Hello world, "


BOTH_PATHS_ITSELF = {"test_the_stream_and_python_decode_alike", "test_a_stream_that_gives_up_goes_on_in_python"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function.__name__ not in BOTH_PATHS_ITSELF:
        metafunc.parametrize("path", ["stream", "python"], indirect=True)


@pytest.fixture(autouse=True)
def path(request, monkeypatch) -> str:
    """How the detokenizers a test makes decode: "python" as without a DecodeStream (unparametrized: "stream")."""
    if getattr(request, "param", "stream") == "python":
        monkeypatch.setattr(engine.detokenizer, "_stream", lambda backend, context: None)
    return getattr(request, "param", "stream")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    return tok(PROMPT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def byte_ids(tok) -> list[int]:
    """byte_ids[b]: the token that is exactly byte b (GPT-2's alphabet, which byte-level vocabularies are written in)."""
    table = {b: tok.convert_tokens_to_ids(c) for c, b in _BYTE_OF.items()}
    ids = list(table.values())
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == 256
    return [table[b] for b in range(256)]


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], min_tokens: int = 0) -> tuple[list[str], int | None]:
    """Feeds `ids` as the engine does; returns the deltas and the index of the token that matched a stop."""
    deltas = []
    for i, t in enumerate(ids):
        if detok.add_token(t, i >= min_tokens):
            deltas.append(detok.delta(True))
            return deltas, i
        deltas.append(detok.delta(False))
    detok.flush(len(ids) > min_tokens)
    deltas.append(detok.delta(True))
    return deltas, None


def by_bytes(byte_ids: list[int], text: str) -> list[int]:
    return [byte_ids[b] for b in text.encode()]


# -- no stop strings: the deltas are the decode ------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 1023), max_size=40))
def test_deltas_concatenate_to_the_full_decode(tok, prompt_ids, ids):
    deltas, stopped = stream(IncrementalDetokenizer(tok, prompt_ids, []), ids)
    assert stopped is None
    assert "".join(deltas) == decode(tok, ids)


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12))
def test_valid_utf8_is_never_split(tok, prompt_ids, byte_ids, text):
    # NOTE: a special token's text ("<|im_start|>", which Hypothesis found) tokenizes to that special token, which
    # output text skips: not a split character
    assume(not any(s in text for s in tok.all_special_tokens))
    for ids in (by_bytes(byte_ids, text), tok(text, add_special_tokens=False)["input_ids"]):
        deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids, []), ids)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == text


def test_emoji_and_cjk_fed_one_token_at_a_time(tok, prompt_ids, byte_ids):
    text = "héllo 😀 世界"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # the multi-byte characters really are split across tokens
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids, []), ids)
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text

    deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids, []), by_bytes(byte_ids, "😀世"))
    assert deltas == ["", "", "", "😀", "", "", "世", ""]  # a character appears with its last byte


def test_a_truncated_character_comes_out_at_the_end(tok, prompt_ids, byte_ids):
    ids = by_bytes(byte_ids, "ok 😀")[:-1]  # generation stopped mid-character (max_tokens)
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids, []), ids)
    assert deltas[:3] == ["o", "k", " "] and "".join(deltas) == decode(tok, ids)


def test_special_tokens_are_not_shown(tok, prompt_ids, byte_ids):
    ids = [*by_bytes(byte_ids, "a"), 0, 1, *by_bytes(byte_ids, "b")]
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids, []), ids)
    assert "".join(deltas) == "ab"


# -- stop strings ------------------------------------------------------------------------------


def expected_stop(text: str, stops: list[str]) -> str | None:
    """The text an engine growing `text` one character at a time shows: cut at the first stop to complete."""
    for end in range(1, len(text) + 1):
        hits = [i for s in stops if (i := text.find(s, 0, end)) >= 0]
        if hits:
            return text[: min(hits)]
    return None


@settings(max_examples=100, deadline=None)
@given(
    text=st.text("ab c世", max_size=24),
    stops=st.lists(st.text("ab c世", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_never_leak(tok, prompt_ids, byte_ids, text, stops):
    ids = by_bytes(byte_ids, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, stops)
    want = expected_stop(text, stops)
    final = text if want is None else want
    shown = ""
    for i, t in enumerate(ids):
        matched = detok.add_token(t)
        shown += detok.delta(matched)
        assert final.startswith(shown), f"showed {shown!r}, but the final text is {final!r}"
        if matched:
            break
    else:
        assert want is None, f"missed a stop string: {stops} in {text!r}"
        detok.flush()
        shown += detok.delta(True)
    assert shown == final
    assert not any(s in shown for s in stops)


def test_stop_string_spanning_tokens_is_held_back_then_cut(tok, prompt_ids, byte_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, ["STOP"])
    shown = []
    for t in by_bytes(byte_ids, "go STO"):
        assert not detok.add_token(t)
        shown.append(detok.delta(False))
    assert shown == ["g", "o", " ", "", "", ""]  # "S", "ST", "STO" could begin the stop: held back
    assert detok.add_token(byte_ids[ord("P")])
    assert detok.delta(True) == "" and "".join(shown) == "go " and detok.num_chars == 3


def test_a_stop_string_kept_in_the_output_ends_it(tok, prompt_ids, byte_ids):
    """`include_stop_str_in_output` (vLLM's): the text ends after the first match, which is shown; nothing after it
    (the rest of the token that completed it) is."""
    detok = IncrementalDetokenizer(tok, prompt_ids, ["STOP", "OP!"], include_stop=True)
    deltas, stopped = stream(detok, by_bytes(byte_ids, "go STOP!!"))
    assert stopped == 6 and "".join(deltas) == "go STOP" and detok.num_chars == 7
    ids = tok(" hello world", add_special_tokens=False)["input_ids"]
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt_ids, ["llo"], include_stop=True), ids)
    assert "".join(deltas) == " hello"  # matched inside one token: cut after the match, not the token


def test_held_back_text_is_released_when_it_is_not_a_stop(tok, prompt_ids, byte_ids):
    ids = by_bytes(byte_ids, "STx世y世界")
    deltas, stopped = stream(IncrementalDetokenizer(tok, prompt_ids, ["STOP", "世界"]), ids)
    assert stopped == len(ids) - 1
    #                  S   T   x      世 (3 bytes)   y      世 (3 bytes)  界 (3 bytes, matches)
    assert deltas == ["", "", "STx", "", "", "", "世y", "", "", "", "", "", ""]


def test_held_back_text_is_released_at_the_end(tok, prompt_ids, byte_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, ["STOP"])
    deltas, stopped = stream(detok, by_bytes(byte_ids, "abST"))
    assert stopped is None and deltas == ["a", "b", "", "", "ST"]


def test_stop_string_inside_one_token(tok, prompt_ids):
    ids = tok(" hello world", add_special_tokens=False)["input_ids"]
    deltas, stopped = stream(IncrementalDetokenizer(tok, prompt_ids, ["llo"]), ids)
    assert stopped is not None and "".join(deltas) == " he"


@pytest.mark.parametrize("min_tokens, stops, stopped, text", [
    (0, ["at"], 6, "the c"),
    (6, ["at"], 6, "the c"),  # the 7th token completes the stop string: it may end the request
    (7, ["at"], 10, "the cat s"),  # not the 7th: the stop string in its text is never looked for, the next one is
    (5, ["cat"], 6, "the "),  # one that begins in the first tokens' text and ends after them counts
    (7, ["cat", "at"], 10, "the cat s"),
    (22, ["at"], None, "the cat sat on the mat"),
    (21, ["at"], 21, "the cat sat on the m"),
])
def test_stop_strings_only_after_min_tokens(tok, prompt_ids, byte_ids, min_tokens, stops, stopped, text):
    deltas, at = stream(IncrementalDetokenizer(tok, prompt_ids, stops), by_bytes(byte_ids, "the cat sat on the mat"),
                        min_tokens)
    assert at == stopped and "".join(deltas) == text


@pytest.mark.parametrize("stops", [[], ["xyz!", "q"]])
def test_the_text_kept_is_what_is_not_shown_yet_and_a_stop_strings_length_before_it(tok, prompt_ids, byte_ids, stops):
    """A long output's text is not kept whole (appending to it would copy it every token): only what waits, and
    with stop strings the characters where one may begin."""
    detok = IncrementalDetokenizer(tok, prompt_ids, stops)
    text = "hello world, xyz and then some " * 100
    shown = []
    for t in by_bytes(byte_ids, text):
        assert not detok.add_token(t)
        shown.append(detok.delta(False))
        assert len(detok.buf) <= detok.num_chars - detok.emitted + max((len(s) - 1 for s in stops), default=0)
    assert "".join(shown) + detok.delta(True) == text and detok.num_chars == len(text)


def test_earliest_stop_wins(tok, prompt_ids, byte_ids):
    deltas, stopped = stream(IncrementalDetokenizer(tok, prompt_ids, ["cd", "bcd"]), by_bytes(byte_ids, "abcdef"))
    assert stopped == 3 and "".join(deltas) == "a"


# -- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eng(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=512, max_model_len=1024))


def test_engine_stop_string(eng):
    prompt = "Hello world, the model streams"
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    full = eng.generate([prompt], greedy)[0]
    # a printable 3-character piece from the middle of the greedy text
    start = next(i for i in range(len(full.text) // 3, len(full.text) - 3) if full.text[i : i + 3].isprintable()
                 and "\ufffd" not in full.text[i : i + 3])
    stop = full.text[start : start + 3]
    cut = full.text.find(stop)
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop])
    # streamed: no delta may show any of the stop string
    eng.add_request("s", prompt, p)
    deltas, last = [], None
    while eng.has_unfinished():
        for o in eng.step():
            deltas.append(o.text_delta)
            last = o
    assert last.finished and last.finish_reason == "stop"
    assert "".join(deltas) == full.text[:cut]
    assert stop not in "".join(deltas)
    out = eng.generate([prompt], p)[0]
    assert out.finish_reason == "stop" and out.text == full.text[:cut]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < 32
    # min_tokens: the token that completes the stop string may end the request only if it is not among the first
    k = len(out.token_ids)
    same = eng.generate([prompt], replace(p, min_tokens=k - 1))[0]
    assert (same.token_ids, same.text, same.finish_reason) == (out.token_ids, out.text, "stop")
    late = eng.generate([prompt], replace(p, min_tokens=k))[0]
    assert late.text.startswith(full.text[: cut + len(stop)])
    assert late.token_ids == full.token_ids[: len(late.token_ids)]
    assert late.finish_reason == "length" or late.text.count(stop) == 1  # a later one ends it


# -- DecodeStream and the Python decoding side by side ---------------------------------------------


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's decoder: "▁" for spaces, bytes as <0xNN> tokens, the leading
    space stripped), built by hand: a few words, and every byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁Hello", "▁world", "lo", "▁a", "b", "."]
    tk = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>")


def _deltas(tok, context: list[int], ids: list[int], stops: list[str], python: bool) -> tuple[list[str], bool]:
    """The deltas, and whether they came from a stream."""
    d = IncrementalDetokenizer(tok, context, stops)
    if python:
        d.stream = None
    streamed = d.stream is not None
    deltas, _ = stream(d, ids)
    return deltas, streamed


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_the_stream_and_python_decode_alike(tok, kind):
    t = tok if kind == "byte-level" else _metaspace_tokenizer()
    vocab, streamed = len(t), 0
    rng = random.Random(15)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        context = ids[: rng.randrange(0, 7)]
        out = ids[len(context) :]
        stops = rng.choice([[], [t.decode(ids[-2:])[-2:] or "x"]])
        fast, used = _deltas(t, context, out, stops, False)
        assert fast == _deltas(t, context, out, stops, True)[0], (context, out, stops)
        # a context ending mid-character decodes in Python (the stream would repeat it)
        assert used == (not t.decode(context, skip_special_tokens=True).endswith("\ufffd")), context
        streamed += used
    assert streamed >= 100  # most contexts: the metaspace vocabulary is mostly bytes, often mid-character


def test_leading_spaces_come_from_the_prompt(path):
    t = _metaspace_tokenizer()
    hello, world = t.convert_tokens_to_ids(["▁Hello", "▁world"])
    assert "".join(_deltas(t, [], [hello, world], [], path == "python")[0]) == "Hello world"
    assert "".join(_deltas(t, [hello], [world], [], path == "python")[0]) == " world"  # not stripped: mid-text


def test_a_stream_that_gives_up_goes_on_in_python(tok, prompt_ids):
    text = "héllo 😀 世界"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, prompt_ids, [])
    deltas = []
    for i, t in enumerate(ids):
        if i == 3:
            real = d.stream

            class GivesUp:  # what tokenizers does on an invalid prefix
                def step(self, tokenizer, token):
                    real.step(tokenizer, token)
                    raise Exception("Invalid prefix encountered")

            d.stream = GivesUp()
        d.add_token(t)
        deltas.append(d.delta(False))
        if i >= 3:
            assert d.stream is None
    d.flush()
    deltas.append(d.delta(True))
    assert "".join(deltas) == text and all("\ufffd" not in x for x in deltas)
