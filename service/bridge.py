"""The event loop's side of the engine thread (service/engine_thread.py): requests in, outputs to their handles.

Prompts are templated and tokenized on a tokenizer thread of their own: the engine thread only sees ids.
Each engine step's outputs cross to the loop in ONE call, with those of any steps before it the loop has not taken
yet (`on_steps`); undelivered output accumulates (merged) in its `RequestHandle`, so a slow reader costs at most its
own completion, and never blocks the engine.

The loop keeps each request's checkpoint (what its caller has been given). When the engine fails, or a step
runs past `step_timeout`, a new engine process (which loads the model again), or a new engine thread over the
same weights, resumes them all from there. A request in flight at two failures is not resumed again (it fails
alone); more than `MAX_RESTARTS` failures within `RESTART_WINDOW_S`, or a rebuilt engine stuck before its first
step, give up (docs/architecture.md §11).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from engine import Checkpoint, LLMEngine, PromptTooLongError, SamplingParams
from engine.processor import InputProcessor
from service.engine_process import EngineProcess
from service.engine_thread import (
    Abort, Add, EngineHost, EngineReady, EngineThread, StepResult, Stop, freeze_startup_heap,
)
from engine.fair_executor import FairExecutor
from service.handle import GenerateRequest, PromptScores, RequestError, RequestHandle, TokenRate

log = logging.getLogger("sluice.bridge")

T = TypeVar("T")
_Prepared = tuple[list[int], list[list[int]] | None]  # a prompt's ids and its bad_words' (`EngineBridge._prepare`)
TOKENIZER_NICENESS = 10  # added to the tokenizer thread's niceness
MAX_RESTARTS = 3  # engine rebuilds within RESTART_WINDOW_S; one more failure in the window and the service gives up
RESTART_WINDOW_S = 300.0
MAX_REQUEST_LOSSES = 2  # a request in flight at this many engine failures is failed, not resumed: it may be the cause


@dataclass
class _Sent:
    """A request the engine thread has been given: enough to give it to another one."""
    add: Add
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    aborted: bool = False  # an Abort followed it
    losses: int = 0  # engine failures it was in flight at


class EngineBridge:
    """Owns the engine and tokenizer threads. Its methods must be called on the event loop thread; it is the
    loop's one registry of requests in flight (`_handles`)."""

    def __init__(self, engine_factory: Callable[[], LLMEngine], *, max_queued: int,
                 max_queued_per_client: int | None = None, pinned_system_prompts: Sequence[str] = (),
                 metrics: Any = None, step_timeout: float = 0.0, rebuildable: bool = True,
                 engine_process: bool = False) -> None:
        """`max_queued`: requests that may wait for the engine; `max_queued_per_client` of them one client's (None:
        half, so one client never fills the queue for everyone else). `step_timeout`: seconds a step may run before
        its engine is declared stuck and replaced (0: never).
        `rebuildable`: False for a tensor-parallel engine, whose ranks share its fate: a loss then gives up.
        `engine_process`: the engine runs in a process of its own (service/engine_process.py; `engine_factory` must
        pickle), not on a thread of this one."""
        self._factory = engine_factory
        self._rebuildable = rebuildable
        self._pinned = list(pinned_system_prompts)
        self._max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client or max(1, max_queued // 2)
        self._metrics = metrics
        self._step_timeout = step_timeout
        self._host = EngineProcess if engine_process else EngineThread
        self._engine: EngineHost | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._losses: list[float] = []  # when engines failed, within RESTART_WINDOW_S
        self._ids = itertools.count()
        self._handles: dict[str, RequestHandle] = {}
        self._sent: dict[str, _Sent] = {}  # request_id -> what the engine thread was given, in order
        self._queued: dict[str, str | None] = {}  # handles submitted but not started (the admission queue): client
        self._queued_by: Counter[str | None] = Counter()  # the admission queue's requests per client
        # used on the tokenizer thread only, once ready (its frozen token_text on any thread)
        self._processor: InputProcessor | None = None
        self._tokenizer = FairExecutor("sluice-tokenizer", initializer=_yield_to_the_engine)  # clients in turn
        # request_id -> its prompt's ids and bad_words' (`_prepare`), to come, and the ids of the choices that share
        # that prompt (`submit_choices`)
        self._tokenizing: dict[str, tuple[asyncio.Future[_Prepared], list[str]]] = {}
        self._aborted_early: set[str] = set()  # aborted while their prompt was queued or being tokenized
        self._rate = TokenRate()
        self.ready = False
        self.recovering = False  # an engine is being rebuilt: requests wait for it (and are not lost)
        self.num_restarts = 0
        self.fatal: str | None = None
        self.model_name = ""
        self.max_model_len = 0
        self.sampling_defaults: dict[str, Any] = {}  # the model's generation config's, once ready (service/handle.py)
        self.stats: dict[str, Any] = {}

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._host is EngineProcess:
            self._engine = EngineProcess(self._factory, self, loop, self._pinned, spare=self._rebuildable)
        else:
            self._engine = EngineThread(self._factory, self, loop, self._pinned)
        self._engine.start()
        if self._step_timeout > 0:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="sluice-engine-watchdog")

    async def stop(self, timeout: float = 10.0) -> None:
        if self._engine is None:
            return
        self.ready = False  # nothing is submitted from now on
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._engine.send(Stop())
        self._tokenizer.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self._engine.join, timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    @property
    def num_queued(self) -> int:
        """Requests waiting for the engine (submitted, not started)."""
        return len(self._queued)

    def generation_tokens_per_s(self) -> float:
        return self._rate.per_s(time.monotonic())

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, req: GenerateRequest, notify: Callable[[], None]) -> RequestHandle:
        """Queue a request. Raises `RequestError` (prompt_too_long, overloaded, internal) at once for what is
        known without the tokenizer; the rest arrives as the handle's error."""
        return self.submit_choices(req, notify, [req.params])[0]

    def submit_choices(self, req: GenerateRequest, notify: Callable[[], None],
                       params: list[SamplingParams]) -> list[RequestHandle]:
        """Queue one request per entry of `params` (a response's choices, OpenAI's `n`), all on `req`'s prompt, which
        is tokenized once. Raises as `submit`; more choices than the queue holds is invalid_message (naming `n`)."""
        if self.fatal is not None or not self.ready or self._processor is None:
            raise RequestError("internal", "the engine is not running")
        try:
            self._processor.refuse_early(req.prompt, truncated=req.truncate_prompt_tokens is not None,
                                         extra=[x for x in (req.tools, req.documents, req.template_kwargs) if x])
        except PromptTooLongError as e:
            raise RequestError("prompt_too_long", str(e)) from None
        share = self.max_queued_per_client
        if len(params) > share:
            raise RequestError("invalid_message", f"{len(params)} choices are more than the server queues for one "
                                                  f"client ({share}, --max-queued-requests-per-client)", "n")
        if len(self._queued) + len(params) > self._max_queued:
            raise RequestError("overloaded", f"the server queue is full ({self._max_queued} requests "
                                             "waiting); retry later")
        if self._queued_by[req.client] + len(params) > share:
            raise RequestError("overloaded", f"this client has {self._queued_by[req.client]} requests waiting for the "
                                             f"engine, and may have {share} (--max-queued-requests-per-client); "
                                             "retry when they have started")
        handles = [RequestHandle(str(next(self._ids)), req.api, notify, self._processor.token_text) for _ in params]
        future = asyncio.wrap_future(self._tokenizer.submit(req.client, self._prepare, req))
        group = [h.request_id for h in handles]
        for h in handles:
            self._handles[h.request_id] = h
            self._tokenizing[h.request_id] = (future, group)
            self._queued[h.request_id] = req.client
        self._queued_by[req.client] += len(handles)
        future.add_done_callback(lambda f: [self._tokenized(h, req, p, f) for h, p in zip(handles, params)])
        return handles

    def _prepare(self, req: GenerateRequest) -> _Prepared:
        """On the tokenizer thread: the prompt's ids, and its `bad_words`' (so the engine thread tokenizes nothing:
        256 long words are ~35 ms of tokenizer)."""
        assert self._processor is not None
        ids = self._tokenize(req)
        return ids, self._processor.bad_words_ids(req.params.bad_words) if req.params.bad_words else None

    def _tokenize(self, req: GenerateRequest) -> list[int]:
        """On the tokenizer thread."""
        assert self._processor is not None
        template = dict(add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message, tools=req.tools, documents=req.documents,
                        template_kwargs=req.template_kwargs) if req.chat else {}
        ids = self._processor.tokenize(req.prompt, req.chat, req.add_special_tokens, **template)
        return ids[-req.truncate_prompt_tokens:] if req.truncate_prompt_tokens else ids

    async def off_loop(self, client: Hashable, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer thread, in `client`'s turn (engine/fair_executor.py): work too long for the
        loop, where it would hold every stream (a response with a long prompt's logprobs to name and render), delays
        that client's own prompts instead."""
        try:
            future = self._tokenizer.submit(client, fn, *args)
        except RuntimeError:  # shut down: the server is stopping, with little else to serve
            return fn(*args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise  # (this request's own cancellation)
            return fn(*args)  # the executor shut down before the job ran (a server stopping)

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        """A prompt's ids as `submit` makes them (its template, special tokens, truncation): on the tokenizer thread,
        in the client's turn; nothing reaches the engine. Raises `RequestError`: internal before the engine is ready,
        invalid_message for messages the template refuses."""
        if self.fatal is not None or self._processor is None:
            raise RequestError("internal", "the engine is not running")
        try:  # (the flood bound only, not the length check: a prompt somewhat over the context still gets its count)
            self._processor.refuse_early(req.prompt, extra=[x for x in (req.tools, req.documents, req.template_kwargs)
                                                            if x])
        except PromptTooLongError as e:
            raise RequestError("prompt_too_long", str(e)) from None
        try:
            ids = await self.off_loop(req.client, self._tokenize, req)
        except ValueError as e:  # the chat template refused the messages
            raise RequestError("invalid_message", str(e)) from None
        return ids

    async def detokenize(self, client: Hashable, ids: list[int]) -> str:
        """The text of token ids (special tokens written out), on the tokenizer thread. Raises `RequestError`
        (invalid_message) for an id outside the vocabulary, or for more ids than the context holds: no prompt or
        answer is longer, and a decode holds the interpreter's lock throughout (half a million ids: ~0.1 s of every
        stream's time)."""
        processor = self._processor
        if self.fatal is not None or processor is None:
            raise RequestError("internal", "the engine is not running")
        if len(ids) > self.max_model_len:
            raise RequestError("invalid_message", f"{len(ids)} token ids: at most {self.max_model_len} (the context)",
                               "tokens")
        known = min(processor.vocab_size, len(processor.tokenizer))  # (a model's rows past its tokenizer's: no text)
        if ids and not (0 <= min(ids) and max(ids) < known):
            raise RequestError("invalid_message", f"token ids must be in 0..{known - 1}", "tokens")
        return await self.off_loop(client, processor.tokenizer.decode, ids)

    async def token_strs(self, client: Hashable, ids: list[int]) -> list[str]:
        """The tokenizer's own string of each token (a byte-level `Ġworld`, say), as vLLM's /tokenize gives them."""
        assert self._processor is not None
        return await self.off_loop(client, self._processor.tokenizer.convert_ids_to_tokens, ids)

    def name_prompt_logprobs(self, handle: RequestHandle) -> None:
        """On the tokenizer thread (`off_loop`): the handle's prompt logprobs, named."""
        if handle.prompt_scores is not None and handle.prompt_logprobs is None and handle.error is None:
            assert self._processor is not None  # (a failed request's ids may be outside the vocabulary)
            handle.prompt_logprobs = handle.prompt_scores.named(self._processor.token_text)

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request; it finishes with finish_reason "abort" after the engine's next step (or as soon as
        its prompt is tokenized, if it is still being tokenized)."""
        if handle.request_id in self._tokenizing:
            self._aborted_early.add(handle.request_id)
            future, group = self._tokenizing[handle.request_id]
            if self._aborted_early.issuperset(group):  # (the prompt of choices still wanted is tokenized)
                future.cancel()  # a prompt still queued is never tokenized
        elif not handle.finished and self._engine is not None:
            self._engine.send(Abort(handle.request_id))
            if (sent := self._sent.get(handle.request_id)) is not None:
                sent.aborted = True

    def abort_all(self) -> None:
        for handle in list(self._handles.values()):
            self.abort(handle)

    def _tokenized(self, handle: RequestHandle, req: GenerateRequest, params: SamplingParams,
                   future: asyncio.Future[_Prepared]) -> None:
        """On the loop, each client's in submission order (engine/fair_executor.py): hand the ids to the engine, or
        finish the request here."""
        del self._tokenizing[handle.request_id]
        aborted = handle.request_id in self._aborted_early
        self._aborted_early.discard(handle.request_id)
        if handle.finished:  # the engine died meanwhile
            return
        if aborted or future.cancelled():
            # NOTE: started with no prompt computed, as the engine reports an abort: a done follows a start
            self._start(handle, 0, 0, time.monotonic())
            return self._finish(handle, "abort", None)
        try:
            ids, bad_words = future.result()  # unchecked: the engine decides whether they make a prompt
        except ValueError as e:  # the chat template refused the messages
            return self._finish(handle, None, RequestError("invalid_message", str(e)))
        except Exception as e:  # the tokenizer itself failed: ours, not the client's
            log.warning("request %s: tokenizing the prompt failed: %s: %s", handle.request_id, type(e).__name__, e)
            return self._finish(handle, None, RequestError("internal", "the server failed to tokenize the prompt"))
        assert self._engine is not None
        if req.echo_ids:  # (the engine's logprobs, if it sends them, take their place)
            handle.prompt_scores = PromptScores.of(ids, None)
        add = Add(handle.request_id, ids, params, req.fit_max_tokens, req.client,
                  bad_words if params.bad_words == req.params.bad_words else None)  # (a choice's own: the engine's)
        self._sent[handle.request_id] = _Sent(add)
        self._engine.send(add)

    # ---- the engine thread's Listener (called on the loop) -----------------------------------
    def on_ready(self, ready: EngineReady) -> None:
        self.model_name, self.max_model_len, self.stats = ready.model_name, ready.max_model_len, ready.stats
        self.sampling_defaults = ready.sampling_defaults
        self._processor = ready.processor
        freeze_startup_heap()  # (this process's: in --engine-process mode the engine's froze its own)
        self.ready = True
        if self.recovering:
            log.info("engine rebuilt: %d requests resumed", len(self._sent))
        else:
            log.info("engine ready: model=%s max_model_len=%d", ready.model_name, ready.max_model_len)
        self.recovering = False

    def on_fatal(self, message: str) -> None:
        self.fatal = message
        self.ready = self.recovering = False
        if self._engine is not None:
            self._engine.abandon()
        for handle in list(self._handles.values()):
            self._finish(handle, None, RequestError("internal", message))

    def on_lost(self, message: str, kv_intact: bool) -> None:
        self._replace(message, keep_cache=kv_intact)

    async def _watch(self) -> None:
        """The watchdog: an engine whose step has run past `step_timeout` is stuck (a hung device or kernel)."""
        while True:
            await asyncio.sleep(min(1.0, self._step_timeout / 4))
            engine, now = self._engine, time.monotonic()
            since = engine.busy_since if engine is not None else None
            if since is not None and now - since > self._step_timeout and self.fatal is None:
                self._replace(f"the engine has been busy for {now - since:.1f} s, more than the "
                              f"{self._step_timeout:g} s allowed (--engine-iteration-timeout-s)", stuck=True)

    def _replace(self, reason: str, stuck: bool = False, keep_cache: bool = False) -> None:
        """The engine failed or is stuck: a new engine thread resumes every request the old one held, from its
        checkpoint (its caller sees a pause), or, after too many failures in the window, the service gives up.
        `keep_cache`: the old engine's thread has ended and its KV is sound: the new one keeps its prefix cache."""
        old = self._engine
        assert old is not None
        old.abandon(stuck)  # from now on nothing of it reaches this loop, even what it queued already
        now = time.monotonic()
        self._losses = [t for t in self._losses if now - t < RESTART_WINDOW_S] + [now]
        if len(self._losses) > MAX_RESTARTS:
            log.error("%s; the engine failed %d times in %.0f s: giving up", reason, len(self._losses),
                      RESTART_WINDOW_S)
            return self.on_fatal(f"{reason} (the engine failed {len(self._losses)} times in {RESTART_WINDOW_S:.0f} s)")
        if not self._rebuildable:  # a tensor-parallel engine: its ranks share its fate, start the server again
            log.error("%s; a tensor-parallel engine is not rebuilt: giving up", reason)
            return self.on_fatal(f"{reason} (tensor parallel: the server exits, to be started again)")
        if stuck and old.replacement and old.steps_done == 0:  # a hung device hangs every engine built on it
            log.error("%s, and it replaced a failed one without completing a step: giving up", reason)
            return self.on_fatal(f"{reason}; the engine rebuilt after a failure never completed a step")
        log.error("%s; rebuilding the engine and resuming its %d requests", reason, len(self._sent))
        self.recovering = True
        self.num_restarts += 1
        if self._metrics:
            self._metrics.engine_restarts.inc()
        loop = asyncio.get_running_loop()
        if self._host is EngineProcess:  # its weights are gone with its process: loaded again, once that has ended
            assert isinstance(old, EngineProcess)
            host: EngineHost = EngineProcess(self._factory, self, loop, self._pinned, replacement=True, after=old,
                                             counters=self.stats, spare=True)
        else:
            assert isinstance(old, EngineThread)
            # NOTE: the old engine goes through a holder the rebuild empties, so nothing keeps it (its weights) alive
            host = EngineThread(partial(_rebuild, [old.engine] if old.engine else [], self._factory, keep_cache), self,
                                loop, self._pinned, replacement=True)
        for rid, sent in list(self._sent.items()):
            handle = self._handles[rid]
            sent.losses += 1
            if sent.aborted:  # the old engine may have taken the Abort; its "abort" output never came
                if not handle.started:
                    self._start(handle, 0, 0, now)
                self._finish(handle, "abort", None)
            elif sent.losses >= MAX_REQUEST_LOSSES:  # it may be what kills the engine: it fails, the rest go on
                log.warning("request %s was in flight at %d engine failures: failing it", rid, sent.losses)
                self._finish(handle, None, RequestError(
                    "internal", f"the engine failed {sent.losses} times while computing this request"))
            else:
                host.send(replace(sent.add, resume=sent.checkpoint.copy()))
        self._engine = host
        host.start()

    def on_steps(self, results: list[StepResult]) -> None:
        """The steps since the loop's last turn, in order: every output pushed to its handle, then each handle with
        new output notified once, so its consumer sends the steps' output together (one write per socket)."""
        now = time.monotonic()
        notify: dict[str, RequestHandle] = {}  # running requests with new output, by id
        gaps: list[float] = []  # inter-token latencies (one per request with tokens in this turn), observed together
        for result in results:
            self.stats = result.stats  # NOTE: before any consumer wakes, so they read post-step stats
            self._rate.add(now, int(result.stats.get("generation_tokens", 0)))
            for d in result.deliveries:
                handle = self._handles.get(d.request_id)
                if handle is None:
                    continue
                if (sent := self._sent.get(d.request_id)) is not None:
                    sent.checkpoint.advance(d.token_ids, d.text, d.rng_state)
                if not handle.started:
                    self._start(handle, d.num_prompt_tokens, d.num_cached_tokens, result.step_start)
                if d.num_new_tokens:
                    if handle.first_token_at is None:
                        handle.first_token_at = now
                        if self._metrics:
                            self._metrics.observe_first_token(handle.queue_s, now - handle.arrival)
                    elif handle.last_token_at != now:  # (several of this turn's steps arrive together)
                        gaps.append(now - handle.last_token_at)
                    handle.last_token_at = now
                handle.push(d.text, d.num_new_tokens, d.logprobs)
                if d.prompt_logprobs is not None:
                    handle.prompt_scores = d.prompt_logprobs
                if d.finish_reason is not None:
                    notify.pop(d.request_id, None)
                    self._finish(handle, d.finish_reason, None)
                else:
                    notify[d.request_id] = handle
            for f in result.failures:
                handle = self._handles.get(f.request_id)
                if handle is not None:
                    # a client's mistake is routine; a failure of ours is worth a warning
                    log.log(logging.WARNING if f.code == "internal" else logging.INFO, "request %s failed: %s: %s",
                            f.request_id, f.code, f.message)
                    notify.pop(f.request_id, None)
                    self._finish(handle, None, RequestError(f.code, f.message, f.param))
        if gaps and self._metrics:
            self._metrics.observe_inter_tokens(gaps)
        for handle in notify.values():
            handle.notify()

    def _start(self, handle: RequestHandle, prompt_tokens: int, cached_tokens: int, at: float) -> None:
        handle.start(prompt_tokens, cached_tokens, at)
        self._dequeue(handle)

    def _finish(self, handle: RequestHandle, reason: str | None, error: RequestError | None) -> None:
        if not handle.started:
            self._dequeue(handle)
        handle.finish(reason, error)
        del self._handles[handle.request_id]
        self._sent.pop(handle.request_id, None)
        if self._metrics:
            self._metrics.observe_finish(handle, reason if error is None else "error")
        handle.notify()

    def _dequeue(self, handle: RequestHandle) -> None:
        client = self._queued.pop(handle.request_id)
        self._queued_by[client] -= 1
        if not self._queued_by[client]:
            del self._queued_by[client]


def _rebuild(holder: list[LLMEngine], factory: Callable[[], LLMEngine], keep_cache: bool = False) -> LLMEngine:
    """On the new engine thread: a new engine over the old one's weights (taken out of `holder`), and its prefix
    cache with `keep_cache`; loaded again if that fails, the old engine let go first."""
    if holder:
        old = holder.pop()
        try:
            return old.rebuilt(keep_cache)
        except Exception:
            log.exception("a new engine over the old weights failed; loading the model again")
        del old
    return factory()


def _yield_to_the_engine() -> None:
    """The tokenizer thread runs at a lower CPU priority than the engine thread (Linux sets niceness per thread):
    on a busy host, streams that are running come before prompts still being tokenized, as in the scheduler."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: same priority, still off the engine thread
        pass
