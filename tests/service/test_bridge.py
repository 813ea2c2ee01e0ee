"""EngineBridge (service/bridge.py) in-process, over the tiny engine: prompts are templated and tokenized on
the tokenizer thread, never on the engine thread; a request aborted while it is tokenized never reaches the
engine; the checks that need the token count answer as the request's error."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

import engine.engine
import service.engine_thread
from engine import EngineConfig, LLMEngine
from engine.processor import InputProcessor
from service.bridge import EngineBridge
from engine import SamplingParams
from service.handle import GenerateRequest, RequestError, RequestHandle

MAX_LEN = 256


class RecordingProcessor(InputProcessor):
    """Notes the thread of every templating/tokenizing call."""
    calls: list[tuple[str, str]] = []

    def chat_ids(self, messages, add_special_tokens=False, **template):
        self.calls.append(("chat", threading.current_thread().name))
        return super().chat_ids(messages, add_special_tokens, **template)

    def text_ids(self, text, add_special_tokens=True):
        self.calls.append(("text", threading.current_thread().name))
        return super().text_ids(text, add_special_tokens)

    def bad_words_ids(self, words):
        self.calls.append(("bad_words", threading.current_thread().name))
        return super().bad_words_ids(words)


@pytest.fixture
async def bridge(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(engine.engine, "InputProcessor", RecordingProcessor)
    monkeypatch.setattr(service.engine_thread, "InputProcessor", RecordingProcessor)
    b = EngineBridge(lambda: LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                                    max_model_len=MAX_LEN)), max_queued=16)
    b.start()
    for _ in range(600):
        if b.ready:
            break
        await asyncio.sleep(0.05)
    assert b.ready
    RecordingProcessor.calls.clear()  # startup (the engine's own processor, pinning) is the engine thread's
    yield b
    await b.stop()


async def _finish(b: EngineBridge, req: GenerateRequest, abort_at_once: bool = False) -> RequestHandle:
    done = asyncio.Event()
    handle = b.submit(req, done.set)
    if abort_at_once:
        b.abort(handle)
    while not handle.finished:
        done.clear()
        await asyncio.wait_for(done.wait(), 60)
    return handle


async def test_the_engine_thread_never_tokenizes(bridge: EngineBridge) -> None:
    chat = await _finish(bridge, GenerateRequest(prompt=[{"role": "user", "content": "hi"}], chat=True,
                                                 params=SamplingParams(ignore_eos=True, max_tokens=3)))
    text = await _finish(bridge, GenerateRequest(prompt="once upon", chat=False,
                                                 params=SamplingParams(ignore_eos=True, max_tokens=3)))
    assert chat.finish_reason == text.finish_reason == "length" and chat.completion_tokens == 3
    kinds = {kind for kind, _ in RecordingProcessor.calls}
    threads = {name for _, name in RecordingProcessor.calls}
    assert kinds == {"chat", "text"} and all(t.startswith("sluice-tokenizer") for t in threads), threads


async def test_bad_words_are_tokenized_on_the_tokenizer_thread(bridge: EngineBridge) -> None:
    """A request's `bad_words` (256 long words: ~35 ms of tokenizer) are tokenized with its prompt, once for its
    choices, never on the engine thread, where they held every stream; the engine bans them all the same."""
    done = asyncio.Event()
    params = SamplingParams(ignore_eos=True, max_tokens=8, temperature=0.0, logprobs=0)
    req = GenerateRequest(prompt="once upon", chat=False, params=params)
    text, _, lps = (await _finish(bridge, req)).take()
    first_id, first = lps[0][:2]  # (the greedy answer's first token, and its text: banned)
    banned = replace(params, bad_words=[first])
    handles = bridge.submit_choices(replace(req, params=banned), done.set, [banned] * 3)
    while not all(h.finished for h in handles):
        done.clear()
        await asyncio.wait_for(done.wait(), 60)
    assert [(h.finish_reason, h.take()[2][0][0] != first_id) for h in handles] == [("length", True)] * 3, first
    calls = [name for kind, name in RecordingProcessor.calls if kind == "bad_words"]
    assert len(calls) == 1 and calls[0].startswith("sluice-tokenizer"), RecordingProcessor.calls


async def test_abort_while_tokenizing_never_reaches_the_engine(bridge: EngineBridge) -> None:
    steps = bridge.stats.get("num_steps", 0)
    handle = await _finish(bridge, GenerateRequest(prompt="a" * 1000, chat=False, params=SamplingParams(max_tokens=50)),
                           abort_at_once=True)
    assert handle.finish_reason == "abort" and handle.completion_tokens == 0
    assert handle.prompt_tokens == 0  # started, as far as a client can tell: `done` always follows `start`
    assert bridge.num_in_flight == 0 and bridge.num_queued == 0 and bridge.stats.get("num_steps", 0) == steps


async def test_choices_share_one_tokenization(bridge: EngineBridge) -> None:
    """`submit_choices` (OpenAI's `n`): the prompt is templated and tokenized once for every choice; each choice runs
    under its own parameters; aborting one while the prompt is tokenized leaves the others running; more choices
    than the queue holds are refused as invalid, not as a retry-later overload."""
    done = asyncio.Event()
    chat = [{"role": "user", "content": "hi"}]
    params = [SamplingParams(ignore_eos=True, max_tokens=k) for k in (2, 3, 4)]
    handles = bridge.submit_choices(GenerateRequest(prompt=chat, chat=True, params=params[0]), done.set, params)
    bridge.abort(handles[1])
    while not all(h.finished for h in handles):
        done.clear()
        await asyncio.wait_for(done.wait(), 60)
    assert [h.finish_reason for h in handles] == ["length", "abort", "length"]
    assert [handles[0].completion_tokens, handles[2].completion_tokens] == [2, 4]
    assert [kind for kind, _ in RecordingProcessor.calls] == ["chat"]
    assert bridge.num_in_flight == 0 and bridge.num_queued == 0
    with pytest.raises(RequestError) as e:
        bridge.submit_choices(GenerateRequest(prompt="x", chat=False, params=params[0]), done.set, params * 6)
    assert (e.value.code, e.value.param) == ("invalid_message", "n")  # 18 choices; one client queues 8 of 16
    assert "--max-queued-requests-per-client" in e.value.message


async def test_one_client_may_fill_half_the_queue(bridge: EngineBridge) -> None:
    """The queue holds 16, one client (an address) 8 of them: its ninth waiting request is refused as overloaded
    (retry later), another client's still queues; once the first's requests have started, it may queue again."""
    done = asyncio.Event()
    long = SamplingParams(max_tokens=MAX_LEN, ignore_eos=True)

    def ask(client: str, n: int = 1) -> list[RequestHandle]:
        req = GenerateRequest(prompt="hello", chat=False, params=long, client=client)
        return bridge.submit_choices(req, done.set, [long] * n)

    hog = ask("10.0.0.1", 8)
    with pytest.raises(RequestError) as e:
        ask("10.0.0.1")
    assert e.value.code == "overloaded" and "has 8 requests waiting" in e.value.message
    other = ask("10.0.0.2", 8)
    assert bridge.num_queued == 16
    with pytest.raises(RequestError) as e:
        ask("10.0.0.3")
    assert e.value.code == "overloaded" and "queue is full" in e.value.message
    while bridge.num_queued:  # (the engine starts them all: 64 seats)
        done.clear()
        await asyncio.wait_for(done.wait(), 60)
    again = ask("10.0.0.1", 8)
    for h in hog + other + again:
        bridge.abort(h)
    while not all(h.finished for h in hog + other + again):
        done.clear()
        await asyncio.wait_for(done.wait(), 60)
    assert bridge.num_in_flight == 0 and bridge.num_queued == 0


async def test_a_grammar_refused_after_admission_is_the_clients_error(bridge: EngineBridge, monkeypatch) -> None:
    """A structured output that the engine gives up compiling after admitting it (engine/structured.py) comes back
    as invalid_message naming its field, as one refused at once does, not as the engine's failure."""
    import engine.engine
    from engine import StructuredOutput
    from engine.structured import Grammars

    release = threading.Event()
    monkeypatch.setattr(Grammars, "_compile", lambda self, so: release.wait(600))
    monkeypatch.setattr(engine.engine, "COMPILE_TIMEOUT_S", 0.0)
    try:
        handle = await _finish(bridge, GenerateRequest(prompt="x", chat=False, params=SamplingParams(
            structured_output=StructuredOutput("regex", "a+", "guided_regex"))))
    finally:
        release.set()
    assert handle.error is not None and (handle.error.code, handle.error.param) == ("invalid_message", "guided_regex")
    assert "still compiling" in handle.error.message


async def test_a_grammar_too_costly_to_follow_is_the_clients_error(bridge: EngineBridge, monkeypatch) -> None:
    """A structured output whose token mask took longer than MASK_LIMIT_S fails mid-answer as invalid_message naming
    its field, not as the engine's failure."""
    from engine import StructuredOutput, structured

    monkeypatch.setattr(structured, "MASK_LIMIT_S", 0.0)
    handle = await _finish(bridge, GenerateRequest(prompt="x", chat=False, params=SamplingParams(
        max_tokens=8, structured_output=StructuredOutput("regex", "a+", "guided_regex"))))
    assert handle.error is not None and (handle.error.code, handle.error.param) == ("invalid_message", "guided_regex")
    assert "too costly to follow" in handle.error.message


async def test_checks_that_need_the_token_count(bridge: EngineBridge) -> None:
    def req(prompt, max_tokens=None, fit=True):
        return GenerateRequest(prompt=prompt, chat=False, params=SamplingParams(max_tokens=max_tokens), fit_max_tokens=fit)

    with pytest.raises(RequestError) as e:  # known without the tokenizer: refused at once
        bridge.submit(req(list(range(3, 3 + MAX_LEN))), lambda: None)
    assert e.value.code == "prompt_too_long"
    too_long = await _finish(bridge, req("x" * 1000))  # under the early bound (63 tokens); 1,000 once tokenized
    assert too_long.error is not None and too_long.error.code == "prompt_too_long" and "1000 tokens" in too_long.error.message
    bad_id = await _finish(bridge, req([10**6]))
    assert bad_id.error is not None and bad_id.error.code == "invalid_message"
    strict = await _finish(bridge, req(list(range(3, 103)), max_tokens=MAX_LEN - 99, fit=False))
    assert strict.error is not None and strict.error.code == "prompt_too_long" and "at most 156" in strict.error.message
    capped = await _finish(bridge, req(list(range(3, 3 + MAX_LEN - 2)), max_tokens=50))
    assert capped.error is None and capped.completion_tokens <= 2


async def test_steps_taken_together_notify_each_consumer_once(bridge: EngineBridge) -> None:
    """A loop behind the engine (its fan-out slower than a step) takes the steps it missed in one turn: each
    request's output of all of them reaches its consumer merged, woken once (one write per socket)."""
    from tests.service.test_engine_thread import hold_the_loop

    woken = {"a": 0, "b": 0}
    params = SamplingParams(max_tokens=MAX_LEN - 32, ignore_eos=True, temperature=0.0)  # hundreds of steps
    handles = {k: bridge.submit(GenerateRequest(prompt=f"{k} once", chat=False, params=params),
                                lambda k=k: woken.__setitem__(k, woken[k] + 1)) for k in woken}
    while not all(h.completion_tokens for h in handles.values()):
        assert not any(h.finished for h in handles.values()), [h.error for h in handles.values()]  # (else: a hang)
        await asyncio.sleep(0.01)
    for h in handles.values():
        h.take()
    before = dict(woken)
    assert bridge._engine is not None
    hold_the_loop(bridge._engine, 4)  # at least 3 steps posted meanwhile, none taken
    await asyncio.sleep(0)  # the turn that takes them
    taken = {k: h.take()[1] for k, h in handles.items()}
    assert woken == {k: n + 1 for k, n in before.items()} and min(taken.values()) >= 3, (woken, before, taken)
    for h in handles.values():
        bridge.abort(h)
