"""vLLM's `bad_words`: a word's tokens (alone, and after a space) never come out in a row: a one-token word is never
sampled, a longer one's last token not after the others. The same tokens under async scheduling, where the output's
tail at sampling time ends in placeholders."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.processor import bad_words_ids

PROMPT = "Once upon a time"


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=256, max_model_len=1024, **kw))


def _has(out: list[int], seq: list[int]) -> bool:
    return any(out[i : i + len(seq)] == seq for i in range(len(out) - len(seq) + 1))


@pytest.mark.parametrize("ahead", [False, True])
def test_a_word_of_several_tokens_is_cut_at_its_last(tiny_model_dir, ahead):
    eng = _engine(tiny_model_dir, async_scheduling=ahead)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = eng.generate([PROMPT], greedy)[0].token_ids
    # a word the greedy answer writes as two tokens or more after a space
    word, seq = next((w, s) for w in eng.generate([PROMPT], greedy)[0].text.split()
                     for s in bad_words_ids(eng.tokenizer, [w], 1024)[1:] if len(s) > 1 and _has(base, s))
    at = next(i for i in range(len(base)) if base[i : i + len(seq)] == seq)
    out = eng.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, bad_words=[word]))[0]
    assert out.token_ids[: at + len(seq) - 1] == base[: at + len(seq) - 1]  # the same up to the word's last token
    assert out.token_ids[at + len(seq) - 1] != seq[-1]
    assert not any(_has(out.token_ids, s) for s in bad_words_ids(eng.tokenizer, [word], 1024))
    plain = _engine(tiny_model_dir)
    both = SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True, bad_words=[word, "a", "zo"])
    assert plain.generate([PROMPT], both)[0].token_ids == eng.generate([PROMPT], both)[0].token_ids
    eng.close()


def test_both_spellings_of_a_word(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    tok = eng.tokenizer
    seqs = bad_words_ids(tok, ["wepa"], 1024)
    assert seqs == [tok.encode("wepa", add_special_tokens=False), tok.encode(" wepa", add_special_tokens=False)]
    assert bad_words_ids(tok, [" wepa"], 1024) == seqs  # (leading spaces are the variant's to add)


class _Counting:
    """A tokenizer that counts its calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)


def test_bad_words_are_tokenized_in_one_call_once_per_list(tiny_model_dir):
    """256 long words were tokenized on the engine thread for each choice and each prompt of a batch: a batch of
    1,024 prompts held it ~100 s, every stream stopped. Now a list the engine has just seen is not tokenized again
    (and a list is one batched call of the tokenizer)."""
    eng = _engine(tiny_model_dir)
    words = ["wepa", "zo", "wepa", " zo"]
    counting = _Counting(eng.tokenizer)
    assert bad_words_ids(counting, words, 1024) == bad_words_ids(eng.tokenizer, ["wepa", "zo"], 1024)
    assert counting.calls == 1
    prompt = eng.processor.prompt_ids(PROMPT, chat=False)  # (ids: the processor tokenizes no prompt below)
    eng.processor.tokenizer = counting
    eng.generate([prompt] * 12, SamplingParams(max_tokens=2, bad_words=words))
    assert counting.calls == 2  # (the list above, and this batch's 12 prompts: a request's n choices are as many)
    eng.close()
