"""The engine thread: the one thread that builds and touches the `LLMEngine` (docs/architecture.md §1).

`EngineWorker` is what runs on it, wherever that is: in a process of its own (service/engine_process.py, the
default) or on a thread of the server's (`EngineThread`, here). The event loop sends it typed commands (`Add`,
`Abort`, `Stop`); it answers through a `Listener` whose methods its host (an `EngineHost`) schedules on the loop:
`ready` once, then `steps` with the result of every engine step that produced anything; `fatal` once if the engine
cannot be built, `lost` once if it fails while serving. The engine is the one registry of what runs here. A host the
loop has `abandon`ed (it replaced it) reaches the loop no more, even with calls scheduled before.

The worker posts one `on_step` per step; steps the loop has not taken yet are merged: the host keeps them, in order,
until the loop's next turn, and `on_steps` takes them all at once. A loop slower than the engine (its fan-out to N sockets outlasting a short step)
then writes once per socket per turn, not once per step: it catches up instead of falling further behind.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from array import array
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Protocol

from engine import Checkpoint, DeviceError, LLMEngine, PromptTooLongError, RequestOutput, SamplingParams, StepError
from engine.processor import InputProcessor
from service.handle import PromptScores, TokenScores
from service.protocol import ErrorCode

log = logging.getLogger("sluice.engine_thread")


# ---- loop -> engine thread ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    fit_max_tokens: bool  # False: a max_tokens the prompt leaves no room for is refused, not capped
    client: str | None = None  # who asks (the engine shares its seats between clients)
    bad_words_ids: list[list[int]] | None = None  # params.bad_words as token ids, made on the tokenizer thread
    resume: Checkpoint | None = None  # it ran in an engine that failed; its caller has what this holds


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Add | Abort | Stop


# ---- engine thread -> loop ------------------------------------------------------------------
@dataclass(slots=True)
class Delivery:
    """One RequestOutput, made loop-safe: plain values, and logprobs in arrays, unnamed (the engine thread names no
    token: the server does, as a response takes them, service/handle.py `TokenScores`). Nothing
    changes it once posted; not `frozen`, whose `__init__` sets each field through `object.__setattr__` (2.7 against
    0.6 µs here, and one is made per streaming request per step)."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # the engine's: "stop" | "length" | "abort"; None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: TokenScores | None  # its new tokens', unnamed: named when a response takes them (service/handle.py)
    rng_state: Any  # a seeded request's generator state after its new token (for its `Checkpoint`), else None
    # with its first token, if it asked: the prompt's ids and the engine's logprobs of them (the first's None), as
    # they come: named on the server's tokenizer thread when a response needs them (service/handle.py PromptScores)
    prompt_logprobs: PromptScores | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    def __reduce__(self) -> tuple[type[Delivery], tuple[Any, ...]]:
        """Pickled as its fields alone (service/engine_process.py sends one per request per step): 0.4 against
        1.6 ms to pickle and unpickle 256, where the default pickles each slot by name."""
        return Delivery, _DELIVERY_FIELDS(self)


_DELIVERY_FIELDS = attrgetter(*(f.name for f in fields(Delivery)))


@dataclass(frozen=True, slots=True)
class Failure:
    request_id: str
    code: ErrorCode
    message: str
    param: str | None = None  # the request field at fault, when the engine names one


@dataclass(frozen=True, slots=True)
class StepResult:
    step_start: float
    deliveries: list[Delivery]
    failures: list[Failure]
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class EngineReady:
    model_name: str
    max_model_len: int
    stats: dict[str, Any]
    processor: InputProcessor  # for the tokenizer thread, which uses it alone from now on
    sampling_defaults: dict[str, Any]  # the model's generation config's (`LLMEngine.sampling_defaults`)


class Listener(Protocol):
    """The loop side. Its methods run on the event loop, never on the engine thread."""

    def on_ready(self, ready: EngineReady) -> None: ...
    def on_steps(self, results: list[StepResult]) -> None:
        """Every step's result since the last call, in order (at least one)."""
    def on_fatal(self, message: str) -> None: ...
    def on_lost(self, message: str, kv_intact: bool) -> None: ...


class EngineWorker:
    """What runs the engine, on whichever thread hosts it (`EngineThread` here, or the main thread of
    `service.engine_process`): builds it, takes commands from `inbox`, steps, and posts each result as
    `post(listener method name, *args)`. `progress` is shared with the host: [0] the monotonic start of the step
    (or pinning) now running, -1 when none, for the watchdog; [1] the engine steps completed."""

    def __init__(self, factory: Callable[[], LLMEngine], pinned_system_prompts: Sequence[str],
                 inbox: queue.SimpleQueue[Command], post: Callable[..., None], progress: MutableSequence[float], *,
                 watch_build: bool = False, abandoned: Callable[[], bool] = lambda: False,
                 counters: Mapping[str, Any] | None = None) -> None:
        """`watch_build`: the busy mark covers building the engine too (a rebuild over the old one's weights runs the
        device: its pool, CUDA graph capture; a hung one shows there). `abandoned`: true once the host's loop
        replaced this engine: it stops before its next command. `counters`: the `stats()` of the engine this one
        replaces, where its own does not carry them (a new process): its counters go on from them."""
        self._factory = factory
        self._pinned = list(pinned_system_prompts)
        self._inbox = inbox
        self._post = post
        self._progress = progress
        self._watch_build = watch_build
        self._abandoned = abandoned
        self._counters = counters
        self.engine: LLMEngine | None = None  # once built

    def _busy(self, since: float | None) -> None:
        self._progress[0] = -1.0 if since is None else since

    def run(self) -> None:
        try:
            try:
                if self._watch_build:
                    self._busy(time.monotonic())
                engine = self._factory()
                if self._counters:
                    engine.go_on_from(self._counters)
                self._busy(time.monotonic())  # pinning runs the model: a hung device shows here first
                for text in self._pinned:
                    n = engine.pin_prefix(engine.processor.system_prefix_ids(text))
                    log.info("pinned a system prompt prefix of %d tokens", n)
                self._busy(None)
                processor = InputProcessor(engine.model_dir, engine.model_config.vocab_size, engine.max_model_len,
                                           engine.config.chat_template)
                processor.token_text.freeze(processor.vocab_size)  # (the loop names a stream's logprobs too)
            except OSError as e:  # the model directory is missing or unreadable; the message says which and why
                log.error("cannot load the model: %s", e)
                return self._post("on_fatal", f"cannot load the model: {e}")
            except Exception as e:
                log.exception("cannot start the engine")
                return self._post("on_fatal", f"cannot start the engine: {type(e).__name__}: {e}")
            self.engine = engine
            freeze_startup_heap()
            self._post("on_ready", EngineReady(engine.model_name, engine.max_model_len, engine.stats(), processor,
                                                   engine.sampling_defaults))
            while self._iteration(engine):
                pass
            engine.close()  # told to stop: a tensor-parallel engine's other ranks stop with it
        except SystemExit:
            pass
        except BaseException as e:  # NOTE: the thread must never die silently; the loop decides what comes next
            log.exception("the engine failed")
            try:
                # the KV it cached is sound unless the device failed: the model never ran for what it committed
                # after a failure, and this thread touches nothing once it has said so
                self._post("on_lost", f"the engine failed: {type(e).__name__}: {e}", not isinstance(e, DeviceError))
            except SystemExit:
                pass

    def _iteration(self, engine: LLMEngine) -> bool:
        """Take the inbox, run one step, post its results. False once told to stop."""
        commands = [self._inbox.get()] if not engine.has_unfinished() else []  # idle: sleep until there is work
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        failures: list[Failure] = []
        for command in commands:
            if self._abandoned():
                return False
            match command:
                case Stop():
                    return False
                case Add():
                    if (failure := self._admit(engine, command)) is not None:
                        failures.append(failure)
                case Abort(request_id=rid):
                    engine.abort(rid)  # a no-op for a request that already finished
        step_start = time.monotonic()
        outputs = self._step(engine, failures, step_start) if engine.has_unfinished() else []
        deliveries = []
        for o in outputs:
            if o.error is not None and o.error_param is not None:  # refused after admission (its grammar)
                failures.append(Failure(o.request_id, "invalid_message", o.error, o.error_param))
                continue
            if o.error is not None:  # the engine failed it alone
                failures.append(Failure(o.request_id, "internal", "the engine failed on this request"))
                continue
            try:
                deliveries.append(_delivery(o))
            except Exception as e:  # (an output that cannot be carried: it fails alone)
                if o.request_id in engine.requests:
                    engine.fail(o.request_id, e)
                else:
                    log.exception("request %s: its output could not be delivered", o.request_id)
                failures.append(Failure(o.request_id, "internal", "the engine failed on this request"))
        if deliveries or failures:
            self._post("on_step", StepResult(step_start, deliveries, failures, engine.stats()))
        return True

    def _step(self, engine: LLMEngine, failures: list[Failure], started: float) -> list[RequestOutput]:
        """One engine step. Anything but a `StepError` escapes: the engine's state can no longer be trusted, and
        the loop resumes its requests in a new one (docs/architecture.md §11)."""
        self._busy(started)
        try:
            outputs = engine.step()
            self._progress[1] += 1
            return outputs
        except StepError as e:  # the engine dropped exactly these requests; aborts it held come next step
            log.warning("step failed for requests %s: %s", e.request_ids, e)
            failures.extend(Failure(rid, "internal", "the model failed while computing this request")
                            for rid in e.request_ids)
            return e.outputs  # theirs from before the failure (delivered before the failures are)
        finally:
            self._busy(None)

    @staticmethod
    def _admit(engine: LLMEngine, add: Add) -> Failure | None:
        """The engine decides whether a request is valid; its exceptions become protocol errors here."""
        try:
            engine.add_request(add.request_id, add.prompt_ids, add.params, fit_max_tokens=add.fit_max_tokens,
                               resume=add.resume, client=add.client, bad_words_token_ids=add.bad_words_ids)
        except Exception as e:
            if add.resume is None and isinstance(e, PromptTooLongError):
                return Failure(add.request_id, "prompt_too_long", str(e), e.param)
            if add.resume is None and isinstance(e, ValueError):  # the client's mistake
                return Failure(add.request_id, "invalid_message", str(e), getattr(e, "param", None))
            # ours, not the client's (a resumed request was admitted once): this request fails, nothing else does
            log.exception("request %s: admission failed", add.request_id)
            what = "resume" if add.resume is not None else "admit"
            return Failure(add.request_id, "internal", f"the engine failed to {what} this request: {type(e).__name__}")
        return None


class EngineHost:
    """What the loop holds of an engine, wherever it runs: commands in (`send`), the listener's calls out, on the
    loop. An `abandon`ed host (the loop replaced it) reaches the listener no more, even with calls scheduled
    before (checked as each runs)."""

    def __init__(self, listener: Listener, loop: asyncio.AbstractEventLoop, progress: MutableSequence[float], *,
                 replacement: bool) -> None:
        """`replacement`: its engine replaces one that failed (the loop's watchdog treats it differently)."""
        self._listener = listener
        self._loop = loop
        self._progress = progress
        self.replacement = replacement
        self.abandoned = False  # set on the loop
        self._steps: list[StepResult] = []  # posted, not yet taken by the loop; non-empty: a `_deliver_steps` is due
        self._steps_lock = threading.Lock()

    @property
    def busy_since(self) -> float | None:
        """Monotonic start of the step (or pinning) now running; None when none is."""
        since = self._progress[0]
        return None if since < 0 else since

    @property
    def steps_done(self) -> int:
        return int(self._progress[1])

    def _schedule(self, name: str, *args: Any) -> None:
        """Off the loop: the listener's `name(*args)`, on the loop; an `on_step(result)` joins the steps the loop has
        not taken yet (module docstring). Calls reach the loop in the order made. A closed loop means the server is
        gone."""
        try:
            if name != "on_step":
                self._loop.call_soon_threadsafe(self._deliver, name, args)
                return
            with self._steps_lock:
                self._steps.append(args[0])
                if len(self._steps) > 1 and not self._loop.is_closed():
                    return  # the call that takes the first takes this one too
            self._loop.call_soon_threadsafe(self._deliver_steps)
        except RuntimeError:
            raise SystemExit from None

    def _deliver(self, name: str, args: tuple[Any, ...]) -> None:
        """On the loop."""
        if not self.abandoned:
            getattr(self._listener, name)(*args)

    def _deliver_steps(self) -> None:
        """On the loop: every step posted since the last call, in one."""
        with self._steps_lock:
            results, self._steps = self._steps, []
        if not self.abandoned:
            self._listener.on_steps(results)


class EngineThread(EngineHost):
    """The engine on a thread of the loop's process (docs/architecture.md §1)."""

    def __init__(self, factory: Callable[[], LLMEngine], listener: Listener, loop: asyncio.AbstractEventLoop,
                 pinned_system_prompts: Sequence[str] = (), *, replacement: bool = False) -> None:
        super().__init__(listener, loop, array("d", [-1.0, 0.0]), replacement=replacement)
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._worker = EngineWorker(factory, pinned_system_prompts, self._inbox, self._schedule, self._progress,
                                    watch_build=replacement, abandoned=lambda: self.abandoned)
        self._thread = threading.Thread(target=self._worker.run, name="sluice-engine", daemon=True)

    @property
    def engine(self) -> LLMEngine | None:
        """Its engine, once built (a rebuild over its weights reuses them)."""
        return self._worker.engine

    def start(self) -> None:
        self._thread.start()

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def abandon(self, stuck: bool = False) -> None:
        """On the loop: this thread's engine is replaced. Nothing it scheduled reaches the listener from now on; it
        ends after its current step (a stuck one never returns: its thread stays, a daemon, parked)."""
        self.abandoned = True
        self._inbox.put(Stop())


def freeze_startup_heap() -> None:
    """Once the engine is built: every object made so far (torch's, transformers', the model's Python side: a million
    or more) leaves the cyclic collector's view for good (vLLM does the same). A full collection scans every tracked
    object while it holds the interpreter lock: with them, one took 80-165 ms, long enough to stall every stream of
    the thread or process it ran in; without them, it scans what was made since."""
    gc.collect()
    gc.freeze()


def _delivery(o: RequestOutput) -> Delivery:
    lps = TokenScores.of(o.logprobs) if o.logprobs else None  # (present only when the request asked for them)
    plps = None if o.prompt_logprobs is None else PromptScores.of(o.prompt_token_ids, o.prompt_logprobs)
    return Delivery(o.request_id, o.new_token_ids, o.text_delta, o.finish_reason if o.finished else None,
                    o.num_prompt_tokens, o.num_cached_tokens, lps, o.rng_state, plps)
