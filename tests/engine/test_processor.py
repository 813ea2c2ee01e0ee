"""InputProcessor (engine/processor.py): prompt -> checked token ids, and the cheap early refusal, which must
never refuse a prompt that fits and must refuse a flood of tiny messages without templating it."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import PromptTooLongError
from engine.loader import load_model_config
from engine.processor import EARLY_SLACK, InputProcessor

MAX_LEN = 256


@pytest.fixture(scope="module")
def proc(tiny_model_dir) -> InputProcessor:
    return InputProcessor(tiny_model_dir, load_model_config(tiny_model_dir).vocab_size, MAX_LEN)


def test_prompt_ids_checks(proc: InputProcessor) -> None:
    ids = proc.prompt_ids([{"role": "user", "content": "hi"}], chat=True)
    assert ids == proc.chat_ids([{"role": "user", "content": "hi"}]) and 0 < len(ids) < MAX_LEN
    assert proc.prompt_ids("hello", chat=False) == proc.text_ids("hello")
    assert proc.prompt_ids([5, 6], chat=False) == [5, 6]
    with pytest.raises(ValueError, match="empty"):
        proc.prompt_ids("", chat=False)
    with pytest.raises(ValueError, match="token ids must be in"):
        proc.prompt_ids([proc.vocab_size], chat=False)
    with pytest.raises(PromptTooLongError, match="no room"):
        proc.prompt_ids(list(range(MAX_LEN)), chat=False)
    proc.prompt_ids(list(range(MAX_LEN - 1)), chat=False)  # one token of room is enough
    with pytest.raises(ValueError, match="token ids must be in"):
        proc.prompt_ids([-1, 5], chat=False)


def test_the_chat_templates_options(proc: InputProcessor) -> None:
    """vLLM's (and transformers') `add_generation_prompt` and `continue_final_message`: the prompt ends with the
    assistant turn's opening, with the last message's end of turn, or inside the last message (a prefilled answer
    the model continues). The tiny model's template is ChatML."""
    user = [{"role": "user", "content": "hi"}]
    opened = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert proc.chat_ids(user) == proc.text_ids(opened, add_special_tokens=False)
    assert proc.chat_ids(user, add_generation_prompt=False) == proc.text_ids("<|im_start|>user\nhi<|im_end|>\n")
    prefilled = [*user, {"role": "assistant", "content": "Once upon"}]
    assert proc.tokenize(prefilled, chat=True, add_generation_prompt=False, continue_final_message=True) == \
        proc.text_ids(opened + "Once upon")
    with pytest.raises(ValueError, match="cannot both"):
        proc.tokenize(prefilled, chat=True, continue_final_message=True)


def test_a_text_gets_the_tokenizers_special_tokens_a_chat_its_templates(bos_model_dir) -> None:
    """As Hugging Face's tokenizers and vLLM: a text prompt is tokenized with the tokenizer's own special tokens (this
    one's BOS), a chat as its template writes it; `add_special_tokens` says otherwise; token ids stay as they are."""
    proc = InputProcessor(bos_model_dir, load_model_config(bos_model_dir).vocab_size, MAX_LEN)
    bos = proc.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    chat = [{"role": "user", "content": "hi"}]
    plain = proc.tokenize("hello", chat=False, add_special_tokens=False)
    assert proc.tokenize("hello", chat=False) == [bos] + plain and bos not in plain
    templated = proc.tokenize(chat, chat=True)
    assert templated[0] != bos and proc.tokenize(chat, chat=True, add_special_tokens=True) == [bos] + templated
    assert proc.tokenize([5, 6], chat=False, add_special_tokens=True) == [5, 6]
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=str(bos_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=MAX_LEN))
    eng.add_request("text", "hello", SamplingParams(max_tokens=1))
    eng.add_request("bare", "hello", SamplingParams(max_tokens=1), add_special_tokens=False)
    assert eng.requests["text"].token_ids == [bos] + plain and eng.requests["bare"].token_ids == plain
    for rid in ("text", "bare"):
        eng.abort(rid)
    eng.step()
    with_bos, bare = (eng.generate(["hello"], SamplingParams(max_tokens=1), add_special_tokens=a)[0] for a in (True, False))
    assert (with_bos.num_prompt_tokens, bare.num_prompt_tokens) == (len(plain) + 1, len(plain))


def test_tokenize_does_not_check_the_engine_does(proc: InputProcessor) -> None:
    """A server's tokenizer thread only tokenizes; whether the ids make a prompt is the engine's call (`check`)."""
    too_long = proc.tokenize("x" * 1000, chat=False)
    assert len(too_long) >= MAX_LEN
    with pytest.raises(PromptTooLongError):
        proc.check(too_long)
    assert proc.tokenize([proc.vocab_size], chat=False) == [proc.vocab_size]
    with pytest.raises(ValueError, match="cannot build the prompt"):
        proc.tokenize([{"role": "nobody", "content": "x"}, {"role": "assistant"}], chat=True)


def test_system_prefix_is_what_conversations_with_that_system_prompt_share(proc: InputProcessor) -> None:
    system = "You are terse."
    prefix = proc.system_prefix_ids(system)
    for user in ("hi", "what is a paged KV cache?"):
        ids = proc.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": user}])
        assert ids[: len(prefix)] == prefix
    assert proc.tokenizer.decode(prefix).startswith("<|im_start|>system\nYou are terse.<|im_end|>")


def test_a_template_adds_tokens_per_message(proc: InputProcessor) -> None:
    assert proc.tokens_per_message >= 2  # ChatML: <|im_start|>, role, newline, <|im_end|>, newline


def test_many_tiny_messages_are_refused_without_templating(proc: InputProcessor, monkeypatch) -> None:
    monkeypatch.setattr(proc, "chat_ids", lambda _: pytest.fail("templated"))
    with pytest.raises(PromptTooLongError, match="28000 messages"):
        proc.refuse_early([{"role": "user", "content": "x"}] * 28_000)
    with pytest.raises(PromptTooLongError, match="characters"):
        proc.refuse_early("x" * 16 * EARLY_SLACK * MAX_LEN)
    proc.refuse_early("x" * 16 * MAX_LEN)  # a bound with slack: templates may drop content, so it is tokenized
    with pytest.raises(PromptTooLongError, match="tokens"):
        proc.refuse_early(list(range(MAX_LEN)))  # ids are counted exactly


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), _text), min_size=1, max_size=80))
def test_early_refusal_never_refuses_a_prompt_that_fits(proc: InputProcessor, turns) -> None:
    messages = [{"role": r, "content": c} for r, c in turns]
    try:
        proc.refuse_early(messages)
    except PromptTooLongError:
        assert len(proc.chat_ids(messages)) >= MAX_LEN, "refused a prompt that fits"
