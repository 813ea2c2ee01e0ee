"""engine/train.py: the corpus (deterministic, held-out material kept out), and training that resumes to the same
weights it would have reached in one sitting. The shipped model itself: tests/engine/test_default_model.py."""
from __future__ import annotations

import json

from safetensors.torch import load_file

from engine import train

TINY = dict(steps=4, batch=2, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=96, vocab=600, save_every=1, warmup=2)


def test_corpus_is_deterministic_and_keeps_held_out_material_out():
    a_train, a_held, a_objects = train.corpus(0)
    b_train, b_held, _ = train.corpus(0)
    assert [c.messages for c in a_train] == [c.messages for c in b_train] and len(a_held) == len(b_held)
    assert a_held and len(a_held) < 0.1 * len(a_train)
    assert not {c.key for c in a_train} & {c.key for c in a_held}
    assert sorted(a_objects) == sorted(train.HELD_OUT_OBJECTS)
    texts = "\n".join(train.render(c.messages) for c in a_train)
    for name in train.HELD_OUT_OBJECTS:
        assert f"`{name}`" not in texts and f"`{name}(" not in texts
    kinds = {c.key.split(":")[0] for c in a_train}
    assert kinds == {"topic", "object", "copy"}


def test_answer_mask_covers_the_assistant_text_and_its_end():
    chats, _, _ = train.corpus(0)
    from engine.tiny import build_tokenizer

    tok = build_tokenizer(600, 0, [train.render(c.messages) for c in chats[:200]])
    chat = chats[0]
    (ids, answer), = train.encode(tok, [chat])
    assert ids == tok(train.render(chat.messages), add_special_tokens=False)["input_ids"][: train.SEQ]
    assert tok.decode([i for i, a in zip(ids, answer) if a]).startswith(chat.messages[1]["content"][:40])
    assert tok.convert_ids_to_tokens(ids[max(j for j, a in enumerate(answer) if a)]) == "<|im_end|>"


def test_training_in_two_sittings_equals_one(tmp_path):
    one = train.train(train.Args(out=str(tmp_path / "one"), **TINY), progress=False)
    assert train.train(train.Args(out=str(tmp_path / "two"), **TINY), progress=False, stop_after=2) is None
    assert (tmp_path / "two" / "train-state.pt").exists() and not (tmp_path / "two" / "model.safetensors").exists()
    two = train.train(train.Args(out=str(tmp_path / "two"), **TINY), progress=False)
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    report = json.loads((two / "train.json").read_text())
    assert report["held_out_answer_loss"] > 0 and report["args"]["steps"] == 4
    assert not (two / "train-state.pt").exists()
    cfg = json.loads((two / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] <= 600


def test_a_second_phase_goes_on_from_the_first_with_its_tokenizer(tmp_path):
    first = train.train(train.Args(out=str(tmp_path / "one"), **TINY), progress=False)
    second = train.train(train.Args(out=str(tmp_path / "two"), **{**TINY, "steps": 2}, init=str(first), scrambled=30),
                         progress=False)
    assert (second / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()
    report = json.loads((second / "train.json").read_text())
    assert report["train_chats"] > json.loads((first / "train.json").read_text())["train_chats"]  # the copying chats
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert any((a[k] != b[k]).any() for k in a)  # trained on from there
    chats, _, _ = train.corpus(0, 30)
    scrambled = [c for c in chats if c.key.startswith("scrambled:")]
    assert scrambled and all(c.messages[-1]["content"].split() for c in scrambled)
