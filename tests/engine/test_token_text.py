"""TokenText: a token's own bytes and name for logprobs. The bytes of a text's tokens join to the text's bytes, also
where a character is split over tokens (decoding each token alone would give U+FFFD for every piece), on the tiny
model's byte-level BPE and on a SentencePiece-style tokenizer with byte fallback."""
from __future__ import annotations

import pytest

from engine.detokenizer import TokenText
from tests.engine.test_detokenizer import _metaspace_tokenizer

TEXT = "héllo ͤ 😊 世界, plain words"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_byte_level_pieces_join_to_the_text(tok):
    tt = TokenText(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert b"".join(tt.bytes(i) for i in ids) == TEXT.encode()
    split = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert split, "the text has characters split over tokens"
    names = [tt.name(i) for i in split]
    assert all(n.startswith("\\x") for n in names) and len(set(names)) == len(set(split))  # told apart, unlike U+FFFD


def test_every_byte_level_token_decodes_as_its_bytes(tok):
    tt = TokenText(tok)
    for i in range(len(tok)):
        if i not in tt.special:
            assert tt.bytes(i).decode("utf-8", "replace") == tok.decode([i]), i


def test_special_tokens_are_named_by_their_content_and_have_no_bytes(tok):
    """The text never shows them (skip_special_tokens), so the bytes of a text's tokens stay its bytes."""
    tt = TokenText(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tt.name(im_end) == "<|im_end|>" and tt.bytes(im_end) == b""


def test_byte_fallback_and_metaspace():
    t = _metaspace_tokenizer()
    tt = TokenText(t)
    assert tt.byte_fallback and tt.metaspace and not tt.byte_level
    text = "Hello world é😊"
    ids = t(text, add_special_tokens=False)["input_ids"]
    assert any(t.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    assert b"".join(tt.bytes(i) for i in ids) == b" " + text.encode()  # a leading "▁" is a space of its own
    assert tt.bytes(t.convert_tokens_to_ids("<0xE2>")) == b"\xe2" and tt.name(t.convert_tokens_to_ids("<0xE2>")) == "\\xe2"


def test_a_frozen_token_text_names_every_id_as_before_without_its_tokenizer(tok):
    """`freeze` reads every name and bytes at once: the same as read one by one, up to the model's size (rows past the
    tokenizer's: no bytes, named ""), and then no call touches the tokenizer, so the loop may name a stream's logprobs
    while the tokenizer thread tokenizes with it."""
    lazy, frozen = TokenText(tok), TokenText(tok).freeze(len(tok) + 8)

    class Gone:
        def __getattr__(self, name):
            raise AssertionError(f"the tokenizer was used: {name}")

    frozen.tokenizer = Gone()
    ids = range(len(tok) + 8)
    assert [frozen.name(i) for i in ids] == [lazy.name(i) for i in ids] == frozen.names
    assert [frozen.bytes(i) for i in ids] == [lazy.bytes(i) for i in ids] == frozen.raw
    assert frozen.name(len(tok) + 3) == "" and frozen.bytes(len(tok) + 3) == b""
    assert (frozen.name(10**6), frozen.bytes(10**6)) == ("", b"")
