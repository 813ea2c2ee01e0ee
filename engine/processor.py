"""`InputProcessor`: prompt -> token ids (chat template, tokenizer) and the length checks that need them.

It owns its own tokenizer, so it runs on whichever ONE thread holds it: the engine keeps one for its own
API, and the server runs a second on a tokenizer thread, so the engine thread only ever sees token ids.
`refuse_early` is the cheap bound checked before any of that work, on the caller's thread.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from engine import loader
from engine.detokenizer import TokenText
from engine.request import PromptTooLongError

log = logging.getLogger("sluice.engine")

# NOTE: no tokenizer packs more characters than this into one token of ordinary text; a prompt's token
# count is therefore at least its characters / this, which bounds it before anything is tokenized.
MAX_CHARS_PER_TOKEN = 16
# The early bound refuses only prompts it puts past this many contexts: a guard against floods, not the length
# check (that runs on the tokens). Some templates drop content (Qwen3 strips earlier turns' <think> text,
# Llama 2 drops a system message that is not first), so a prompt's characters can overstate its tokens.
EARLY_SLACK = 4

Messages = Sequence[Any]  # {"role", "content"} dicts, or objects with those attributes


class InputProcessor:
    def __init__(self, model_dir: str | Path, vocab_size: int, max_model_len: int,
                 chat_template: str | None = None) -> None:
        """`chat_template`: a Jinja chat template's text in place of the model's own (vLLM's `--chat-template`);
        raises `ValueError` if it does not parse."""
        self.tokenizer = loader.load_tokenizer(model_dir)
        if chat_template is not None:
            import jinja2

            try:  # (compiled as transformers compiles it, with its extensions: a bad template fails here, at once)
                from transformers.utils.chat_template_utils import _compile_jinja_template
            except ImportError:  # (a transformers that moved it: the first chat finds the error instead)
                _compile_jinja_template = str
            try:
                _compile_jinja_template(chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat_template: line {e.lineno}: {e.message}") from None
            self.tokenizer.chat_template = chat_template
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokens_per_message = self._tokens_per_message()
        if self.tokens_per_message == 0:
            log.warning("the chat template's tokens per message could not be measured: prompts with many short "
                        "messages are only bounded by their characters before they are tokenized")

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """A request's `bad_words` as token id sequences (`bad_words_ids`, below)."""
        return bad_words_ids(self.tokenizer, words, self.vocab_size)

    @cached_property
    def token_text(self) -> TokenText:
        """Token names and bytes over this tokenizer, for a server's logprobs (service/handle.py; frozen by the server)."""
        return TokenText(self.tokenizer)

    def chat_ids(self, messages: Messages, add_special_tokens: bool = False, *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                 documents: list[dict[str, Any]] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The chat template applied to `messages`, tokenized (the template writes the special tokens it wants: the
        tokenizer's own, a BOS say, are added only if asked). A message is a `{"role", "content"}` dict or any object
        with those attributes (a server's wire type). As vLLM's and transformers' options of the same names:
        `add_generation_prompt` ends the prompt with the opening of the assistant's turn; `continue_final_message`
        instead leaves the last message open, so the answer continues its text (a prefilled answer); `tools` (OpenAI's
        function tools) are the template's to show, as it writes them (one that does not mention them leaves them
        out), and so are `documents` (a RAG template's) and `template_kwargs` (more variables: Qwen3's
        `enable_thinking`, say)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        messages = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, tools=tools or None,
                                                  documents=documents or None, **(template_kwargs or {}))
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` tokenized, with the special tokens the tokenizer adds to a text (Llama's BOS; none for many), as
        Hugging Face's tokenizers and vLLM's completions do by default: a model trained with them expects them."""
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def tokenize(self, prompt: Messages | str | list[int], chat: bool, add_special_tokens: bool | None = None,
                 **template: bool) -> list[int]:
        """Token ids of a prompt, unchecked: what a server's tokenizer thread does. `add_special_tokens` (vLLM's):
        the tokenizer's own special tokens (None: for a text, not for a chat, whose template writes them; token ids
        are taken as they are); `template`: `chat_ids`' options. Raises `ValueError` if the chat template refuses the
        messages."""
        if chat:
            try:
                return self.chat_ids(prompt, bool(add_special_tokens), **template)  # type: ignore[arg-type]
            except Exception as e:  # e.g. a template that rejects this sequence of roles
                raise ValueError(f"cannot build the prompt: {e}") from None
        if isinstance(prompt, str):
            return self.text_ids(prompt, add_special_tokens is not False)
        return list(prompt)

    def check(self, ids: list[int]) -> list[int]:
        """`ids`, if they make a prompt: not empty, in the vocabulary, shorter than the context.

        Raises `PromptTooLongError` (no room for one new token) or `ValueError` (anything else)."""
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in 0..{self.vocab_size - 1}")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; the context is {self.max_model_len} "
                                     "tokens, leaving no room for a completion")
        return ids

    def prompt_ids(self, prompt: Messages | str | list[int], chat: bool, add_special_tokens: bool | None = None
                   ) -> list[int]:
        """`check(tokenize(prompt, chat, add_special_tokens))`."""
        return self.check(self.tokenize(prompt, chat, add_special_tokens))

    def system_prefix_ids(self, system_prompt: str) -> list[int]:
        """The templated tokens every conversation that opens with this system prompt shares (what to pin): the
        longest common prefix of two such conversations that differ only in their user message."""
        a, b = (self.chat_ids([{"role": "system", "content": system_prompt}, {"role": "user", "content": u}])
                for u in ("a", "b"))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a[:n]

    def refuse_early(self, prompt: Messages | str | list[int], truncated: bool = False, extra: Any = None) -> None:
        """Raises `PromptTooLongError` for token ids that fill the context, or text whose lower bound on tokens
        fills EARLY_SLACK contexts; with `truncated` (only the prompt's last tokens are kept), token ids too only
        from EARLY_SLACK contexts on.

        O(messages), no tokenizer: characters / MAX_CHARS_PER_TOKEN, plus what the template adds per message
        (28,000 one-character messages are refused here, not after a second of templating). A chat's messages' tool
        calls and `extra` (what else its template is given: tools, documents) count as their JSON's characters."""
        limit = EARLY_SLACK * self.max_model_len
        if isinstance(prompt, str):
            bound, what = math.ceil(len(prompt) / MAX_CHARS_PER_TOKEN), f"{len(prompt)} characters"
        elif prompt and not isinstance(prompt[0], int):
            bound, what = (len(prompt) - 1) * self.tokens_per_message, f"{len(prompt)} messages"
            if bound < limit:  # NOTE: only then read the contents (a flood sends 28,000 messages)
                chars = sum(len((m.get("content") if isinstance(m, dict) else m.content) or "") for m in prompt)
                chars += sum(len(json.dumps(m["tool_calls"])) for m in prompt
                             if isinstance(m, dict) and m.get("tool_calls"))
                chars += len(json.dumps(extra)) if extra else 0
                bound += math.ceil(chars / MAX_CHARS_PER_TOKEN)
                what = f"{len(prompt)} messages of {chars} characters"
        else:
            bound, what = len(prompt), f"{len(prompt)} tokens"
            limit = limit if truncated else self.max_model_len  # exact: no slack
        if bound >= limit:
            raise PromptTooLongError(f"the prompt ({what}) is at least {bound} tokens; the context is "
                                     f"{self.max_model_len} tokens")

    def _tokens_per_message(self) -> int:
        """Fewest tokens the chat template adds for one more (empty) message, minus one that may merge with
        the content; 0 where the template cannot tell (it refuses such conversations)."""
        first = {"role": "user", "content": ""}
        try:
            one = len(self.chat_ids([first]))
        except Exception:
            return 0
        counts = []
        for role in ("system", "user", "assistant"):
            try:
                counts.append(len(self.chat_ids([first, {"role": role, "content": ""}])) - one - 1)
            except Exception:
                continue
        return max(0, min(counts)) if counts else 0


def bad_words_ids(tokenizer: Any, words: list[str], vocab: int) -> list[list[int]]:
    """vLLM's `bad_words` as token id sequences: each word's tokens alone (a text's first word) and after a space (a
    word inside a text), as vLLM tokenizes them; one with an id outside the vocabulary is dropped. (256 words of 256
    letters: ~35 ms, in one batched call of the tokenizer: a server makes them on its tokenizer thread, and the engine
    keeps the latest lists it made itself.)"""
    texts = [text for word in words for text in (word.lstrip(), " " + word.lstrip())]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
        if ids and max(ids) < vocab and (key := tuple(ids)) not in seen:
            seen.add(key)
            out.append(list(ids))
    return out
