"""Structured output (engine/structured.py): a request's text held to a JSON schema, any JSON object, a regular
expression or a choice of strings, under every loop (plain, async outputs, async scheduling, speculation) with the
same tokens, and to its end: the grammar's completion ends the request, even with `ignore_eos`."""
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

import jsonschema
import pytest

from engine import EngineConfig, InvalidSamplingParam, LLMEngine, SamplingParams, StructuredOutput
from tests.engine.test_async_output import streams

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = [[3 + (i * 7919 + j * 31) % 1000 for j in range(12 + i)] for i in range(6)]


def _closing(model) -> dict[int, float]:
    """A bias toward the tokens that end a JSON string or object: with the tiny model's random weights, a free key
    or string would otherwise run on for hundreds of tokens."""
    from engine.loader import load_tokenizer

    tok = load_tokenizer(model)
    return {i: 6.0 for i in range(len(tok)) if any(c in tok.decode([i]) for c in '"}')}


def _params(model) -> list[SamplingParams]:
    """Seeded sampling (the tiny model's random weights make the grammar do all the work), a greedy choice, and a
    free request beside them."""
    return [
        SamplingParams(max_tokens=400, temperature=1.0, seed=1, structured_output=StructuredOutput("json", json.dumps(SCHEMA))),
        SamplingParams(max_tokens=400, temperature=1.0, seed=2, structured_output=StructuredOutput("json_object"),
                       logit_bias=_closing(model)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_output=StructuredOutput("regex", REGEX)),
        SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput.choice(CHOICES)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=4, ignore_eos=True,  # ends anyway: the grammar is done
                       structured_output=StructuredOutput.choice(CHOICES)),
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    ]


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", num_kv_blocks=256,
                                  max_model_len=1024, **kw))


def _texts(got: dict[str, list[tuple]]) -> dict[str, tuple[str, str]]:
    return {rid: ("".join(o[1] for o in outs), outs[-1][3]) for rid, outs in got.items()}


def test_the_text_follows_its_grammar(tiny_model_dir):
    got = _texts(streams(_engine(tiny_model_dir), PROMPTS, _params(tiny_model_dir)))
    assert all(reason == "stop" for rid, (_, reason) in got.items() if rid != "r5"), got
    jsonschema.validate(json.loads(got["r0"][0]), SCHEMA)
    assert isinstance(json.loads(got["r1"][0]), dict)
    assert re.fullmatch(REGEX, got["r2"][0]), got["r2"]
    assert got["r3"][0] in CHOICES and got["r4"][0] in CHOICES
    assert got["r5"][1] == "length"  # (the free request: not held to anything)


@pytest.mark.parametrize("loop", ["async_output_proc", "async_scheduling", "speculative"])
def test_same_tokens_under_every_loop(tiny_model_dir, loop):
    """Under async scheduling a step's grammar masks are made once the step before it is committed (its sampling is
    queued after that commit); speculation never drafts for such a request."""
    kw = {"speculative": "ngram", "num_speculative_tokens": 3} if loop == "speculative" else {loop: True}
    plain, other = _engine(tiny_model_dir), _engine(tiny_model_dir, **kw)
    a, b = streams(plain, PROMPTS, _params(tiny_model_dir)), streams(other, PROMPTS, _params(tiny_model_dir))
    tokens = {rid: [t for o in outs for t in o[0]] for rid, outs in a.items()}
    assert tokens == {rid: [t for o in outs for t in o[0]] for rid, outs in b.items()}
    assert _texts(a) == _texts(b)
    if loop == "speculative":
        assert other.stats()["spec_draft_tokens"] > 0  # (the free request drafted; the others never)


def test_refused(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    for so, match in ((StructuredOutput("json", "{not json"), "cannot compile"),
                      (StructuredOutput("regex", "[a-", "guided_regex"), "cannot compile")):
        with pytest.raises(InvalidSamplingParam, match=match) as e:
            eng.add_request("bad", [5, 6, 7], SamplingParams(structured_output=so))
        assert e.value.param == so.param
    for clash in ({"min_tokens": 2}, {"allowed_token_ids": [5, 6]}):
        with pytest.raises(InvalidSamplingParam, match="cannot be combined") as e:
            eng.add_request("bad", [5, 6, 7], SamplingParams(structured_output=StructuredOutput("json_object"), **clash))
        assert e.value.param == "response_format"
    with pytest.raises(InvalidSamplingParam, match="matches no text") as e:  # (nothing to draw: refused)
        eng.add_request("none", [5, 6, 7], SamplingParams(structured_output=StructuredOutput("regex", r"[^\s\S]")))
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml")
    # every special token but EOS is kept out (the text never shows them): <|im_start|> too, which the tokenizer's
    # all_special_ids leaves out
    banned = eng.runner.sampler.grammars.banned
    assert eng.tokenizer.convert_tokens_to_ids("<|im_start|>") in banned and not set(banned) & eng.eos_token_ids
    start = eng.tokenizer.convert_tokens_to_ids("<|im_start|>")
    (out,) = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0.0, logit_bias={start: 100.0},
                                                       structured_output=StructuredOutput.choice(["<|im_start|>", "ok"])))
    assert start not in out.token_ids and out.text == "ok"  # (its bias would have made it win every step)
    assert not eng.requests


def _held_compiles(eng: LLMEngine, monkeypatch) -> tuple[threading.Event, list]:
    """The engine's grammar compiles wait for the returned event (a compile that takes as long as the test says);
    the list records what they compiled."""
    from engine.structured import Grammars

    release, seen = threading.Event(), []
    compile_ = Grammars._compile

    def held(self, so):
        seen.append(so)
        assert release.wait(600)
        return compile_(self, so)

    monkeypatch.setattr(Grammars, "_compile", held)
    return release, seen


def test_a_slow_compile_holds_back_only_its_request(tiny_model_dir, monkeypatch):
    """A grammar compiles on a thread of its own: the engine steps the other requests meanwhile, schedules the
    request once it is compiled, and refuses (naming the field) one that cannot be compiled."""
    eng = _engine(tiny_model_dir)
    release, seen = _held_compiles(eng, monkeypatch)
    eng.add_request("free", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    eng.add_request("held", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0,
                                                       structured_output=StructuredOutput.choice(CHOICES)))
    eng.add_request("bad", PROMPTS[2], SamplingParams(structured_output=StructuredOutput("regex", "[a-", "guided_regex")))
    eng.add_request("gone", PROMPTS[3], SamplingParams(structured_output=StructuredOutput("json_object")))
    eng.abort("gone")  # while it compiles
    got: dict[str, list] = {}
    while "free" not in got or not got["free"][-1].finished:  # the free request runs to its end meanwhile
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    assert "held" not in got and "bad" not in got and got["gone"][-1].finish_reason == "abort"
    assert eng.stats()["num_waiting"] == 2 and eng.has_unfinished()
    release.set()
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    assert "".join(o.text_delta for o in got["held"]) in CHOICES and got["held"][-1].finish_reason == "stop"
    bad = got["bad"][-1]
    assert bad.finished and bad.error_param == "guided_regex" and "cannot compile" in bad.error
    assert len(seen) == 2 and not eng.requests  # ("gone", aborted while its compile was queued: never compiled)
    eng.check_integrity()
    if sys.platform == "linux":  # compiles at the process's priority (a request waits wall time for its own)
        (thread,) = [t for t in threading.enumerate() if t.name == "sluice-grammar"]
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == os.getpriority(os.PRIO_PROCESS, 0)


def test_a_compile_past_its_time_is_refused(tiny_model_dir, monkeypatch):
    """The time limit counts from the compile's start: a request whose compile waits behind another's is not refused
    for the time it waited."""
    import engine.engine

    eng = _engine(tiny_model_dir)
    release, seen = _held_compiles(eng, monkeypatch)
    monkeypatch.setattr(engine.engine, "COMPILE_TIMEOUT_S", 0.0)
    eng.add_request("slow", PROMPTS[0], SamplingParams(structured_output=StructuredOutput("json_object")))
    eng.add_request("queued", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0,
                                                         structured_output=StructuredOutput.choice(CHOICES)))
    _wait_for(lambda: len(seen) == 1)  # ("slow"'s compile has begun, and holds the thread)
    (out,) = eng.step()
    assert out.request_id == "slow" and out.error_param == "response_format" and "still compiling" in out.error
    monkeypatch.setattr(engine.engine, "COMPILE_TIMEOUT_S", 600.0)
    release.set()
    got = {o.request_id: o for o in _run(eng)}
    assert got["queued"].finish_reason == "stop" and not got["queued"].error


def test_a_queued_compile_no_request_waits_for_is_dropped(tiny_model_dir, monkeypatch):
    """A client that cancels its structured requests leaves no compile queued before others' (a hostile one could
    stack minutes of them): a compile not begun is dropped with its last request; one still wanted is kept."""
    eng = _engine(tiny_model_dir)
    release, seen = _held_compiles(eng, monkeypatch)
    held = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput.choice(CHOICES))
    eng.add_request("first", PROMPTS[0], SamplingParams(structured_output=StructuredOutput("json_object")))
    _wait_for(lambda: len(seen) == 1)  # (its compile runs, held: the next ones queue)
    eng.add_request("a", PROMPTS[1], held)
    eng.add_request("b", PROMPTS[2], held)  # (the same grammar: one compile for both)
    eng.add_request("c", PROMPTS[3], SamplingParams(structured_output=StructuredOutput("regex", "[0-9]+")))
    for rid in ("a", "c", "first"):
        eng.abort(rid)
    release.set()
    got = {o.request_id: o for o in _run(eng)}
    assert got["b"].finish_reason == "stop" and {got[r].finish_reason for r in "ac"} == {"abort"}
    assert [so.kind for so in seen] == ["json_object", "choice"]  # ("c"'s regex never compiled)
    assert not eng.runner.sampler.grammars._waiting  # (nothing counted for requests gone)
    eng.add_request("again", PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0,
                                                        structured_output=StructuredOutput("regex", "[0-9]+")))
    assert _run(eng)[-1].finish_reason in ("stop", "length")  # (a dropped compile is not kept as a failure)
    eng.check_integrity()


def test_a_compile_given_up_while_it_runs_is_waited_for_again(tiny_model_dir, monkeypatch):
    """A request that let go of a compile already running (it cannot be stopped), then one with the same grammar (a
    client cancelling and retrying): the second waits for that compile (it failed with a KeyError)."""
    eng = _engine(tiny_model_dir)
    release, seen = _held_compiles(eng, monkeypatch)
    held = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput.choice(CHOICES))
    eng.add_request("first", PROMPTS[0], held)
    _wait_for(lambda: len(seen) == 1)
    eng.abort("first")
    eng.step()
    eng.add_request("again", PROMPTS[1], held)
    release.set()
    got = {o.request_id: o for o in _run(eng)}
    assert got["again"].finish_reason == "stop" and not got["again"].error and len(seen) == 1
    assert not eng.runner.sampler.grammars._waiting


def test_clients_take_turns_at_the_compile_thread(tiny_model_dir, monkeypatch):
    """One client's queued compiles (a hostile one's dozen distinct schemas, each up to COMPILE_TIMEOUT_S) hold another
    client's next compile behind one of them, not all: the clients with compiles queued take turns, each in its own
    order (in arrival order, b's waited for all of a's)."""
    eng = _engine(tiny_model_dir)
    release, seen = _held_compiles(eng, monkeypatch)
    digits = [StructuredOutput("regex", f"[0-9]{{{i}}}") for i in range(1, 5)]
    eng.add_request("a0", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, structured_output=digits[0]),
                    client="a")
    _wait_for(lambda: len(seen) == 1)  # (a0's compile runs, held: the rest queue)
    for i in range(1, 4):
        eng.add_request(f"a{i}", PROMPTS[i], SamplingParams(max_tokens=8, temperature=0.0,
                                                            structured_output=digits[i]), client="a")
    eng.add_request("b0", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0.0,
                                                     structured_output=StructuredOutput.choice(CHOICES)), client="b")
    release.set()
    got = {o.request_id: o for o in _run(eng)}
    assert [so.spec for so in seen] == [digits[0].spec, digits[1].spec, json.dumps(CHOICES), digits[2].spec,
                                        digits[3].spec]
    assert all(o.finished and not o.error for o in got.values()) and len(got) == 5
    eng.check_integrity()


def test_a_schema_another_client_queued_too_is_compiled_in_the_first_turn_of_either(tiny_model_dir, monkeypatch):
    """A schema a's requests queued behind a's own slow ones, which b then asks for too (a common one: its compile is
    cached and shared), is compiled in b's turn, before a's later ones, and serves a's request as well: before, b's
    request waited in a's queue, behind all of them. The time limit counts from when the compile began."""
    eng = _engine(tiny_model_dir)
    release, seen = _held_compiles(eng, monkeypatch)
    digits = [StructuredOutput("regex", f"[0-9]{{{i}}}") for i in range(1, 4)]
    common = StructuredOutput.choice(CHOICES)
    eng.add_request("a0", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, structured_output=digits[0]),
                    client="a")
    _wait_for(lambda: len(seen) == 1)  # (a0's compile runs, held: the rest queue)
    for i, so in enumerate([digits[1], digits[2], common], 1):
        eng.add_request(f"a{i}", PROMPTS[i], SamplingParams(max_tokens=8, temperature=0.0, structured_output=so),
                        client="a")
    eng.add_request("b0", PROMPTS[4], SamplingParams(max_tokens=8, temperature=0.0, structured_output=common),
                    client="b")
    release.set()
    outs = _run(eng)
    got = {o.request_id: o for o in outs}
    assert [so.spec for so in seen] == [digits[0].spec, digits[1].spec, common.spec, digits[2].spec]  # (once)
    assert all(o.finished and not o.error for o in got.values()) and len(got) == 5
    for rid in ("a3", "b0"):
        assert "".join(o.text_delta for o in outs if o.request_id == rid) in CHOICES
    eng.check_integrity()


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def _run(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def _masks_ahead(monkeypatch, hold: threading.Event | None = None) -> list[str]:
    """Every grammar's masks made ahead, on the mask thread (as a slow grammar's are); with `hold`, those wait for
    it. The list records the thread each mask was made on."""
    from engine import structured

    made, fill = [], structured._fill

    def timed(matcher, bitmask, row=0):
        name = threading.current_thread().name
        made.append(name if name != "sluice-grammar-mask" or sys.platform != "linux"
                    else f"{name} (nice {os.getpriority(os.PRIO_PROCESS, threading.get_native_id())})")
        if hold is not None and name.startswith("sluice-grammar-mask"):
            assert hold.wait(600)
        return fill(matcher, bitmask, row)

    monkeypatch.setattr(structured, "SLOW_MASK_S", 0.0)
    monkeypatch.setattr(structured, "_fill", timed)
    return made


@pytest.mark.parametrize("loop", ["plain", "async_output_proc", "async_scheduling"])
def test_slow_masks_are_made_off_the_step_with_the_same_tokens(tiny_model_dir, monkeypatch, loop):
    """A request whose grammar is slow to follow has each next mask made on the mask thread once its token is
    committed, and is scheduled when it is ready: the tokens are those of masks made in the step."""
    kw = {} if loop == "plain" else {loop: True}
    inline = streams(_engine(tiny_model_dir, **kw), PROMPTS, _params(tiny_model_dir))
    made = _masks_ahead(monkeypatch)
    ahead = streams(_engine(tiny_model_dir, **kw), PROMPTS, _params(tiny_model_dir))
    # (the first masks are made at admission; on Linux the thread's work yields to the step's)
    assert made.count("sluice-grammar-mask" + (" (nice 19)" if sys.platform == "linux" else "")) > 20
    tokens = {rid: [t for o in outs for t in o[0]] for rid, outs in inline.items()}
    assert tokens == {rid: [t for o in outs for t in o[0]] for rid, outs in ahead.items()}
    assert _texts(inline) == _texts(ahead)


@pytest.mark.parametrize("loop", ["plain", "async_scheduling"])
def test_a_slow_mask_holds_back_only_its_request(tiny_model_dir, monkeypatch, loop):
    """While a slow grammar's next mask is being made the engine steps the others: the free request runs to its end
    with the structured one's mask still to come; then the structured one goes on and keeps to its grammar."""
    hold = threading.Event()
    _masks_ahead(monkeypatch, hold)
    eng = _engine(tiny_model_dir, **({} if loop == "plain" else {loop: True}))
    try:
        eng.add_request("free", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        eng.add_request("held", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.0,
                                                           structured_output=StructuredOutput("regex", REGEX)))
        got: dict[str, list] = {}
        while "free" not in got or not got["free"][-1].finished:
            for o in eng.step():
                got.setdefault(o.request_id, []).append(o)
        # its first token (from the grammar's start mask, made at admission), then nothing: its next mask is held
        assert sum(len(o.new_token_ids) for o in got["held"]) == 1 and not got["held"][-1].finished
        assert len(got["free"]) >= 30
    finally:
        hold.set()
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    assert re.fullmatch(REGEX, "".join(o.text_delta for o in got["held"])) and got["held"][-1].finish_reason == "stop"
    eng.check_integrity()


def test_a_mask_past_its_limit_fails_its_request(tiny_model_dir, monkeypatch):
    """A grammar whose mask took longer than MASK_LIMIT_S fails its request (its field named, as a refusal); the
    others go on."""
    from engine import structured

    monkeypatch.setattr(structured, "MASK_LIMIT_S", 0.0)
    eng = _engine(tiny_model_dir)
    got = streams(eng, PROMPTS[:2], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                                     SamplingParams(max_tokens=20, temperature=0.0, structured_output=StructuredOutput(
                                         "regex", REGEX, "guided_regex"))])
    assert sum(len(o[0]) for o in got["r0"]) == 20
    assert got["r1"][-1][3] == "abort" and "guided_regex: too costly to follow" in got["r1"][-1][6]
    assert not eng.requests


def test_a_finished_requests_queued_mask_is_never_made(tiny_model_dir, monkeypatch):
    """An aborted request's next mask, still queued behind another's, is cancelled: the mask thread skips it and the
    requests behind it do not wait for it."""
    hold = threading.Event()
    made = _masks_ahead(monkeypatch, hold)
    eng = _engine(tiny_model_dir)
    try:
        for rid in ("first", "gone"):
            eng.add_request(rid, PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0,
                                                            structured_output=StructuredOutput("regex", REGEX)))
        first = ""
        while not all(eng.requests[r].mask is not None and not eng.requests[r].mask.done() for r in ("first", "gone")):
            # (both sampled their first token: their next masks are queued, the first's held)
            first += "".join(o.text_delta for o in eng.step() if o.request_id == "first")
        gone = eng.requests["gone"].mask
        eng.abort("gone")
        assert gone.cancelled()
    finally:
        hold.set()
    got = streams(eng, [], [])
    assert [o[3] for o in got["gone"]] == ["abort"] and re.fullmatch(REGEX, first + "".join(o[1] for o in got["first"]))
    # on the mask thread: the first's masks after its first token, none of the other's
    assert made.count(made[-1]) == sum(len(o[0]) for o in got["first"])


def test_a_request_waiting_for_its_mask_is_waited_for_not_spun_on(tiny_model_dir, monkeypatch):
    """A request preempted while its mask is made waits outside `running`: a step with nothing to run waits a little
    for that mask (not a busy loop), and the request comes back once it is ready."""
    import engine.engine

    hold = threading.Event()
    _masks_ahead(monkeypatch, hold)
    waited, wait = [], engine.engine.futures.wait
    monkeypatch.setattr(engine.engine.futures, "wait", lambda fs, **kw: (waited.append(list(fs)), wait(fs, **kw))[1])
    eng = _engine(tiny_model_dir)
    try:
        eng.add_request("s", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0,
                                                        structured_output=StructuredOutput("regex", REGEX)))
        text = ""
        while (req := eng.requests["s"]).mask is None or req.mask.done():
            text += "".join(o.text_delta for o in eng.step())
        eng.scheduler._preempt(req)  # (as an older request's growth would)
        assert eng.step() == [] and waited and waited[-1] == [req.mask]
    finally:
        hold.set()
    got = streams(eng, [], [])
    assert re.fullmatch(REGEX, text + "".join(o[1] for o in got["s"])) and got["s"][-1][3] == "stop"


def test_slow_masks_are_made_in_the_step_again_after_a_run_of_fast_ones():
    """One slow mask sends a request's next masks off the step until FAST_MASKS in a row were fast again (a JSON
    schema's odd slow mask must not halve its pace for good)."""
    from types import SimpleNamespace

    from engine.structured import FAST_MASKS, SLOW_MASK_S, _timed

    req = SimpleNamespace(mask_s=0.0, mask_slow=False, fast_masks=0)
    _timed(req, SLOW_MASK_S / 2)
    assert not req.mask_slow
    _timed(req, SLOW_MASK_S)
    for _ in range(FAST_MASKS - 1):
        _timed(req, SLOW_MASK_S / 2)
        assert req.mask_slow
    _timed(req, SLOW_MASK_S * 3)  # (a slow one starts the run again)
    for _ in range(FAST_MASKS):
        assert req.mask_slow
        _timed(req, 0.0)
    assert not req.mask_slow


@pytest.mark.parametrize("so, pattern", [
    (StructuredOutput("grammar", 'root ::= ("red" | "blue") "-" [0-9] [0-9]?', "guided_grammar"),
     r"(red|blue)-[0-9]{1,2}"),
    (StructuredOutput("grammar", 'start: COLOR "-" DIGIT\nCOLOR: "red" | "blue"\nDIGIT: /[0-9]/', "guided_grammar"),
     r"(red|blue)-[0-9]"),  # (Lark's)
    (StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<n>", "end": "</n>", "content": {"type": "regex", "pattern": "[0-9]{2}"}}})),
     r"<n>[0-9]{2}</n>"),
])
def test_grammars_and_structural_tags(tiny_model_dir, so, pattern):
    """vLLM's guided_grammar (EBNF as xgrammar and GBNF write it, or Lark) and xgrammar's structural tags hold the
    text as the other kinds do; one that cannot be compiled is refused naming its field."""
    eng = _engine(tiny_model_dir)
    (out,) = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=1.0, seed=7, structured_output=so))
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text
    with pytest.raises(InvalidSamplingParam, match="cannot compile") as e:
        eng.add_request("bad", [5, 6], SamplingParams(structured_output=StructuredOutput("grammar", "root ::= ((",
                                                                                         "guided_grammar")))
    assert e.value.param == "guided_grammar"


@pytest.mark.parametrize("so, pattern", [
    (StructuredOutput("regex", REGEX, after="X"), REGEX),
    (StructuredOutput("json", json.dumps(SCHEMA), after="X"), None),
    (StructuredOutput("choice", json.dumps(CHOICES), after="X"), "|".join(map(re.escape, CHOICES))),
])
def test_a_grammar_after_free_text(tiny_model_dir, so, pattern):
    """`after` (a reasoning model's `</think>`): the text up to it is free, the grammar holds what follows. Made to
    happen by construction: `after` is the start of the free greedy answer, which the held request, greedy too,
    writes again (nothing is masked before it), then it follows the grammar."""
    eng = _engine(tiny_model_dir)
    (free,) = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    after = max((eng.tokenizer.decode(free.token_ids[:k]) for k in range(1, 5)), key=lambda t: (
        t.isascii() and t.isprintable(), len(t)))  # (whole characters: the grammar reads bytes)
    assert after.isascii() and after.strip(), after
    so = StructuredOutput(so.kind, so.spec, after=after)
    params = SamplingParams(max_tokens=400, temperature=0.0, structured_output=so, logit_bias=_closing(
        tiny_model_dir) if so.kind == "json" else None)
    (out,) = eng.generate([PROMPTS[1]], params)
    assert out.text.startswith(after) and out.finish_reason == "stop", out.text
    rest = out.text[len(after):]
    if pattern is None:
        jsonschema.validate(json.loads(rest), SCHEMA)
    else:
        assert re.fullmatch(pattern, rest), out.text


def test_free_text_before_after_may_end_and_what_follows_is_checked(tiny_model_dir):
    """A text that never writes `after` is free to end (a model that did not reason); a grammar that matches no text is
    refused under `after` as without it; Lark's token names resolve under it; an `after` that is a special token
    (never in the text) is ignored."""
    from engine.structured import Grammars

    eng = _engine(tiny_model_dir)
    eos = sorted(eng.eos_token_ids)[0]
    grammars = Grammars(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids)
    compiled = grammars.compile(StructuredOutput("regex", REGEX, after="</think>")).result()
    matcher = grammars.xgr.GrammarMatcher(compiled.grammar)
    assert matcher.accept_string("still thinking") and matcher.accept_token(eos) and matcher.is_terminated()
    matcher = grammars.xgr.GrammarMatcher(compiled.grammar)
    assert matcher.accept_string("done</think>") and not matcher.accept_token(eos)  # (now held: the regex first)
    assert matcher.accept_string("123-ab")
    banned = grammars.banned[0]
    for after in ("", "</think>"):
        with pytest.raises(ValueError, match="matches no text"):
            grammars.compile(StructuredOutput("grammar", f"start: <[{banned}]>", after=after)).result()
    special = eng.tokenizer.convert_ids_to_tokens(banned)
    grammars.compile(StructuredOutput("grammar", f'start: "A" {special}', after="</think>")).result()
    held = grammars.xgr.GrammarMatcher(grammars.compile(StructuredOutput("regex", REGEX, after=special)).result()
                                       .grammar)  # (an `after` never in the text: the grammar holds it all)
    assert not held.accept_string("free") and held.accept_string("123-ab")


def test_a_grammar_after_an_opened_free_text(tiny_model_dir):
    """`opens` (qwen3's `<think>`): the free text is only one the answer opens with it, else the grammar holds from
    the start; an unclosed one may end; a grammar that may itself begin with it holds the answer whole."""
    from engine.structured import Grammars

    eng = _engine(tiny_model_dir)
    eos = sorted(eng.eos_token_ids)[0]
    grammars = Grammars(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids)

    def matcher(so: StructuredOutput):
        return grammars.xgr.GrammarMatcher(grammars.compile(so).result().grammar)

    for so, held in [(StructuredOutput("regex", REGEX), "123-ab"),
                     (StructuredOutput("json", json.dumps(SCHEMA)), '{"color": "red", "n": 1, "ok": true}'),
                     (StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": {
                         "type": "const_string", "value": "OK"}})), "OK")]:
        so = StructuredOutput(so.kind, so.spec, after="</think>", opens="<think>")
        m = matcher(so)
        assert m.accept_string("<think>free text</think>" + held) and m.accept_token(eos) and m.is_terminated()
        m = matcher(so)
        assert m.accept_string(held) and m.accept_token(eos)  # (no reasoning: held from the start)
        m = matcher(so)
        assert m.accept_string("<think>never closed") and m.accept_token(eos)
        assert not matcher(so).accept_string("x") and not matcher(so).accept_string(" <think>")
    own = StructuredOutput("regex", "<think>[a-z]+</think>[0-9]", after="</think>", opens="<think>")
    assert matcher(own).accept_string("<think>ab</think>1") and not matcher(own).accept_string("<think>AB")
