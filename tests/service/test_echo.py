"""Completions' `echo` under a Llama-2 / Mistral style tokenizer (SentencePiece's metaspace: a token's bytes begin
with the space its `▁` stands for, which the text's first word does not have): the echoed text is the prompt's tokens
decoded as an answer's text is, and every `text_offset`, the prompt's and the answer's, points at its token's text;
a truncated prompt echoes what was kept; the counts of `logprobs` and `prompt_logprobs` stay apart."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from service.app import build_app
from service.config import ServerConfig
from tests.service.conftest import in_process


@pytest.fixture(scope="module")
def spm_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from engine.tiny import SPECIAL_TOKENS, _corpus

    out = tmp_path_factory.mktemp("spm-model")
    for f in tiny_model_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            (out / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy(f, out / f.name)
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS + [f"<0x{b:02X}>" for b in range(256)],
                                  show_progress=False)
    tok.train_from_iterator(_corpus(0, 40 * 1024), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def http(spm_model_dir: Path):
    config = ServerConfig(model=str(spm_model_dir), served_model_name="spm", num_kv_blocks=256, max_model_len=1024,
                          engine_process=False)
    with in_process(build_app(config), "spm-server") as server, httpx.Client(base_url=server.url, timeout=60) as h:
        yield h


def _complete(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json={"model": "spm", "temperature": 0.0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _check_offsets(text: str, lp: dict) -> None:
    """Each token's offset is where its text begins: the tokens' texts, cut at the offsets, make the text."""
    cuts = [*lp["text_offset"], len(text)]
    assert cuts == sorted(cuts) and cuts[0] == 0
    assert "".join(text[a:b] for a, b in zip(cuts, cuts[1:])) == text


def test_echo_text_and_offsets_agree(http: httpx.Client, spm_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spm_model_dir)
    prompt = "The river runs to the sea"
    r = _complete(http, prompt=prompt, max_tokens=3, echo=True, logprobs=0)
    (c,), n = r["choices"], r["usage"]["prompt_tokens"]
    lp = c["logprobs"]
    assert c["text"].startswith(prompt) and lp["text_offset"][n] == len(prompt), (c["text"], lp)
    assert c["text"][lp["text_offset"][1]:].startswith(tok.decode(tok(prompt).input_ids[1:2]).strip())
    _check_offsets(c["text"], lp)
    ids = tok(prompt).input_ids
    r = _complete(http, prompt=ids[2:], max_tokens=2, echo=True)  # token ids: their text, as decoded
    assert r["choices"][0]["text"].startswith(tok.decode(ids[2:]))
    # (made from the ids, not from prompt logprobs: the prompt is served from the prefix cache, n choices may share it)
    long_ids = tok(" ".join([prompt] * 8)).input_ids
    for _ in range(2):
        r = _complete(http, prompt=long_ids, max_tokens=1, echo=True, n=2)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert all(c["text"].startswith(tok.decode(long_ids)) for c in r["choices"]) and len(r["choices"]) == 2
    # a truncated prompt echoes the tokens kept, and its logprobs are theirs
    r = _complete(http, prompt=prompt, max_tokens=2, echo=True, logprobs=1, truncate_prompt_tokens=3)
    c = r["choices"][0]
    assert c["text"].startswith(tok.decode(ids[-3:])) and r["usage"]["prompt_tokens"] == 3
    _check_offsets(c["text"], c["logprobs"])


def test_logprobs_and_prompt_logprobs_counts_stay_apart(http: httpx.Client) -> None:
    r = _complete(http, prompt="The river runs", max_tokens=1, echo=True, logprobs=1, prompt_logprobs=4)
    (c,), n = r["choices"], r["usage"]["prompt_tokens"]
    assert all(len(top) <= 1 for top in c["logprobs"]["top_logprobs"][1:])
    assert all(4 <= len(e) <= 5 for e in c["prompt_logprobs"][1:]) and len(c["prompt_logprobs"]) == n
    r = _complete(http, prompt="The river runs", max_tokens=1, echo=True, logprobs=4, prompt_logprobs=0)
    assert all(len(e) == 1 for e in r["choices"][0]["prompt_logprobs"][1:])
    r = http.post("/v1/completions", json={"model": "spm", "prompt": "x", "echo": True, "logprobs": 1, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_prompt_logprobs_are_named_and_rendered_off_the_loop(http: httpx.Client, monkeypatch) -> None:
    """A long prompt's logprobs are thousands of entries to name and render: on the tokenizer thread (in the client's
    turn), never on the engine thread or the loop that runs every stream; whole or streamed, the answer is the same."""
    import json
    import threading

    from service.handle import PromptScores
    from service.openai_render import CompletionRender

    seen: list[tuple[str, str]] = []

    def spy(f):
        def wrapped(*args, **kwargs):
            seen.append((f.__name__, threading.current_thread().name))
            return f(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(PromptScores, "named", spy(PromptScores.named))
    monkeypatch.setattr(CompletionRender, "_echo", spy(CompletionRender._echo))
    monkeypatch.setattr(CompletionRender, "_prompt_lps", spy(CompletionRender._prompt_lps))
    body = {"model": "spm", "prompt": "The river runs to the sea", "max_tokens": 3, "temperature": 0.0, "echo": True,
            "logprobs": 2}
    whole = _complete(http, **body, prompt_logprobs=3)["choices"][0]
    assert sorted(seen) == [("_echo", "sluice-tokenizer"), ("_prompt_lps", "sluice-tokenizer"),
                            ("named", "sluice-tokenizer")], seen
    seen.clear()
    text, tokens = "", []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                (c,) = json.loads(line[6:])["choices"]
                text += c["text"]
                tokens += (c["logprobs"] or {}).get("tokens", [])
    assert sorted(seen) == [("_echo", "sluice-tokenizer"), ("named", "sluice-tokenizer")], seen
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
