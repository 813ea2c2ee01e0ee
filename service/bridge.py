"""Engine thread <-> event loop. The engine is built and used on one thread only; each step's outputs
cross to the loop in ONE `call_soon_threadsafe`. Undelivered output accumulates (merged) in its
`RequestHandle`, so a slow reader costs at most its own completion, and never blocks the engine.
Prompts are templated and tokenized on a tokenizer thread of their own: the engine thread only sees ids.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine import PromptTooLongError, RequestOutput, SamplingParams, StepError
from engine.processor import InputProcessor
from service.handle import GenerateRequest, RequestError, RequestHandle, TokenLogprobs, TokenRate

log = logging.getLogger("sluice.bridge")

MAX_CONSECUTIVE_FAILURES = 3  # unexpected step exceptions in a row before the engine is declared dead
TOKENIZER_NICENESS = 10  # added to the tokenizer thread's niceness


@dataclass(frozen=True)
class _Delivery:
    """One RequestOutput, made loop-safe: token strings of logprobs are decoded on the engine thread."""
    request_id: str
    num_new_tokens: int
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None


@dataclass(frozen=True)
class _StepBatch:
    step_start: float
    deliveries: list[_Delivery]
    errors: list[tuple[str, str, str]]  # (request_id, code, message)
    stats: dict[str, Any]


def _aborted_output(request_id: str) -> Any:
    return RequestOutput(request_id=request_id, new_token_ids=[], text_delta="", finished=True,
                         finish_reason="abort", num_prompt_tokens=0, num_cached_tokens=0)


class EngineBridge:
    """Owns the engine thread. Loop-side methods must be called on the event loop thread."""

    def __init__(self, engine_factory: Callable[[], Any], *, max_queued: int,
                 pinned_system_prompts: Sequence[str] = (), metrics: Any = None) -> None:
        self._factory = engine_factory
        self._pinned = list(pinned_system_prompts)
        self._max_queued = max_queued
        self._metrics = metrics
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._handles: dict[str, RequestHandle] = {}
        self._num_queued = 0  # handles submitted but not started: the admission queue
        self._processor: InputProcessor | None = None  # used on the tokenizer thread only, once ready
        self._tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-tokenizer",
                                                                initializer=_yield_to_the_engine)
        self._tokenizing: dict[str, asyncio.Future[list[int]]] = {}  # request_id -> its prompt's ids, to come
        self._aborted_early: set[str] = set()  # aborted while their prompt was queued or being tokenized
        self._rate = TokenRate()
        self.ready = False
        self.fatal: str | None = None
        self.model_name = ""
        self.max_model_len = 0
        self.stats: dict[str, Any] = {}

    # ---- loop side -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=_EngineWorker(self).run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self.ready = False  # nothing is submitted from now on
        self._inbox.put(("stop",))
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def generation_tokens_per_s(self) -> float:
        return self._rate.per_s(time.monotonic())

    def submit(self, req: GenerateRequest, notify: Callable[[], None]) -> RequestHandle:
        """Queue a request. Raises `RequestError` (invalid_message, prompt_too_long, overloaded, internal) at
        once for what is known without the tokenizer; the rest arrives as the handle's error."""
        if self.fatal is not None or not self.ready or self._processor is None:
            raise RequestError("internal", "the engine is not running")
        try:  # validate ranges here so the client hears about them now, not from the engine thread
            SamplingParams(max_tokens=req.max_tokens or 1, logprobs=req.logprobs, **req.sampling)
        except (ValueError, TypeError) as e:
            raise RequestError("invalid_message", f"invalid sampling parameters: {e}") from None
        try:
            self._processor.refuse_early(req.prompt)
        except PromptTooLongError as e:
            raise RequestError("prompt_too_long", str(e)) from None
        if self._num_queued >= self._max_queued:
            raise RequestError("overloaded", f"the server queue is full ({self._max_queued} requests "
                                             "waiting); retry later")
        handle = RequestHandle(str(next(self._ids)), req.api, notify)
        self._handles[handle.request_id] = handle
        self._num_queued += 1
        assert self._loop is not None
        future = self._tokenizing[handle.request_id] = self._loop.run_in_executor(
            self._tokenizer, self._processor.prompt_ids, req.prompt, req.chat)
        future.add_done_callback(lambda f: self._tokenized(handle, req, f))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request; it finishes with finish_reason "abort" after the engine's next step (or as soon as
        its prompt is tokenized, if it is still being tokenized)."""
        if handle.request_id in self._tokenizing:
            self._aborted_early.add(handle.request_id)
            self._tokenizing[handle.request_id].cancel()  # a prompt still queued is never tokenized
        elif not handle.finished:
            self._inbox.put(("abort", handle.request_id))

    def _tokenized(self, handle: RequestHandle, req: GenerateRequest, future: asyncio.Future[list[int]]) -> None:
        """On the loop, in submission order: hand the ids to the engine, or finish the request here."""
        del self._tokenizing[handle.request_id]
        aborted = handle.request_id in self._aborted_early
        self._aborted_early.discard(handle.request_id)
        if handle.finished:  # the engine died meanwhile
            return
        if aborted or future.cancelled():
            # NOTE: "started" with no prompt computed, as the engine reports an abort: a done follows a start
            handle.prompt_tokens = 0
            self._num_queued -= 1
            return self._finish(handle, "abort", None)
        try:
            ids = future.result()
        except PromptTooLongError as e:
            return self._finish(handle, None, RequestError("prompt_too_long", str(e)))
        except ValueError as e:
            return self._finish(handle, None, RequestError("invalid_message", str(e)))
        except Exception as e:  # the tokenizer itself failed: ours, not the client's
            log.warning("request %s: tokenizing the prompt failed: %s: %s", handle.request_id, type(e).__name__, e)
            return self._finish(handle, None, RequestError("internal", "the server failed to tokenize the prompt"))
        room = self.max_model_len - len(ids)
        if req.max_tokens is not None and req.max_tokens > room and not req.fit_max_tokens:
            return self._finish(handle, None, RequestError(
                "prompt_too_long", f"the context is {self.max_model_len} tokens; the prompt has {len(ids)} and "
                                   f"max_tokens asks for {req.max_tokens} more (at most {room} fit)"))
        max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
        self._inbox.put(("add", handle.request_id, ids, req, max_tokens))

    def abort_all(self) -> None:
        for handle in list(self._handles.values()):
            self.abort(handle)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        """Engine thread -> loop. A closed loop means the server is gone; the thread just ends."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            raise SystemExit from None

    def _on_ready(self, model_name: str, max_model_len: int, stats: dict[str, Any], processor: InputProcessor) -> None:
        self.model_name, self.max_model_len, self.stats = model_name, max_model_len, stats
        self._processor = processor
        self.ready = True
        log.info("engine ready: model=%s max_model_len=%d", model_name, max_model_len)

    def _on_fatal(self, message: str) -> None:
        self.fatal = message
        self.ready = False
        for handle in list(self._handles.values()):
            self._finish(handle, None, RequestError("internal", message))

    def _dispatch(self, batch: _StepBatch) -> None:
        now = time.monotonic()
        self.stats = batch.stats  # NOTE: before any consumer wakes, so they read post-step stats
        self._rate.add(now, int(batch.stats.get("generation_tokens", 0)))
        for d in batch.deliveries:
            handle = self._handles.get(d.request_id)
            if handle is None:
                continue
            if handle.prompt_tokens is None:
                handle.prompt_tokens, handle.cached_tokens = d.num_prompt_tokens, d.num_cached_tokens
                handle.queue_s = max(0.0, batch.step_start - handle.arrival)
                self._num_queued -= 1
            if d.num_new_tokens:
                if handle.first_token_at is None:
                    handle.first_token_at = now
                    if self._metrics:
                        self._metrics.observe_first_token(handle.queue_s, now - handle.arrival)
                elif self._metrics:
                    self._metrics.observe_inter_token(now - handle.last_token_at)
                handle.last_token_at = now
            handle.push(d.text, d.num_new_tokens, d.logprobs)
            if d.finish_reason is not None:
                self._finish(handle, d.finish_reason, None)
            else:
                handle.notify()
        for rid, code, message in batch.errors:
            handle = self._handles.get(rid)
            if handle is not None:
                # a client's mistake is routine; a failure of ours is worth a warning
                log.log(logging.WARNING if code == "internal" else logging.INFO, "request %s failed: %s: %s",
                        rid, code, message)
                self._finish(handle, None, RequestError(code, message))

    def _finish(self, handle: RequestHandle, reason: str | None, error: RequestError | None) -> None:
        handle.finish(reason, error)
        del self._handles[handle.request_id]
        if handle.prompt_tokens is None:
            self._num_queued -= 1
        if self._metrics:
            self._metrics.observe_finish(handle, reason if error is None else "error")
        handle.notify()


class _EngineWorker:
    """The engine thread's side. It alone touches the engine; it talks to the loop only via `post`."""

    def __init__(self, bridge: EngineBridge) -> None:
        self.bridge = bridge
        self.post = bridge._call
        self.live: dict[str, int | None] = {}  # request_id -> logprobs wanted: what the engine holds
        self.aborting: set[str] = set()  # aborted, their "abort" output not seen yet
        self.failures = 0  # unexpected step exceptions in a row

    def run(self) -> None:
        try:
            try:
                engine = self.bridge._factory()
            except OSError as e:  # the model directory is missing or unreadable; the message says which and why
                log.error("cannot load the model: %s", e)
                self.post(self.bridge._on_fatal, f"cannot load the model: {e}")
                return
            for text in self.bridge._pinned:
                self._pin(engine, text)
            # the tokenizer thread's own processor (and tokenizer): built here, used only there from now on
            processor = InputProcessor(engine.model_dir, engine.model_config.vocab_size, engine.max_model_len)
            self.post(self.bridge._on_ready, engine.model_name, engine.max_model_len, engine.stats(), processor)
            while self._iteration(engine):
                pass
        except SystemExit:
            pass
        except BaseException as e:  # NOTE: the thread must never die silently
            log.exception("engine thread crashed")
            try:
                self.post(self.bridge._on_fatal, f"engine failed: {type(e).__name__}: {e}")
            except SystemExit:
                pass

    def _iteration(self, engine: Any) -> bool:
        """Take the inbox, run one step, post its outputs. False once told to stop."""
        inbox = self.bridge._inbox
        cmds = [inbox.get()] if not engine.has_unfinished() else []  # idle: sleep until there is work
        while True:
            try:
                cmds.append(inbox.get_nowait())
            except queue.Empty:
                break
        errors: list[tuple[str, str, str]] = []
        aborted = False
        for cmd in cmds:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                err = self._admit(engine, *cmd[1:])
                if err is None:
                    self.live[cmd[1]] = cmd[3].logprobs
                else:
                    errors.append((cmd[1], err.code, err.message))
            elif cmd[0] == "abort" and cmd[1] in self.live and cmd[1] not in self.aborting:
                engine.abort(cmd[1])
                self.aborting.add(cmd[1])
                aborted = True
        step_start = time.monotonic()
        outs = self._step(engine, errors) if engine.has_unfinished() or aborted else []
        deliveries = [self._convert(engine, o, self.live.get(o.request_id)) for o in outs]
        for o in outs:
            if o.finished:
                self.live.pop(o.request_id, None)
                self.aborting.discard(o.request_id)
        if deliveries or errors:
            self.post(self.bridge._dispatch, _StepBatch(step_start, deliveries, errors, engine.stats()))
        return True

    def _step(self, engine: Any, errors: list[tuple[str, str, str]]) -> list[Any]:
        try:
            outs = engine.step()
            self.failures = 0
            return outs
        except StepError as e:  # the engine already dropped exactly these requests
            log.warning("step failed for requests %s: %s", e.request_ids, e)
            for rid in e.request_ids:
                self.live.pop(rid, None)
                self.aborting.discard(rid)
                errors.append((rid, "internal", "the model failed while computing this request"))
            # NOTE: a failed step may swallow the "abort" outputs it was about to report; finish
            # those here, or their clients would wait forever.
            return [_aborted_output(rid) for rid in self.aborting]
        except Exception as e:
            self.failures += 1
            log.exception("engine step failed (%d in a row); failing all %d requests", self.failures, len(self.live))
            if self.failures >= MAX_CONSECUTIVE_FAILURES:
                raise
            for rid in self.live:
                try:
                    engine.abort(rid)
                except Exception:
                    log.exception("abort of request %s failed", rid)
            errors.extend((rid, "internal", f"engine step failed: {type(e).__name__}") for rid in self.live)
            self.live.clear()
            self.aborting.clear()
            return []

    @staticmethod
    def _admit(engine: Any, rid: str, ids: list[int], req: GenerateRequest, max_tokens: int) -> RequestError | None:
        try:
            params = SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, **req.sampling)
            engine.add_request(rid, ids, params)
        except PromptTooLongError as e:  # the engine's own length checks
            return RequestError("prompt_too_long", str(e))
        except ValueError as e:  # anything else the engine refuses about this request
            return RequestError("invalid_message", str(e))
        return None

    @staticmethod
    def _convert(engine: Any, o: Any, want_logprobs: int | None) -> _Delivery:
        lps = None
        if want_logprobs is not None and o.logprobs:
            dec = engine.tokenizer.decode
            lps = [(dec([lp.token_id]), lp.logprob, [(dec([t]), v) for t, v in lp.top]) for lp in o.logprobs]
        reason = (o.finish_reason or "stop") if o.finished else None
        return _Delivery(o.request_id, len(o.new_token_ids), o.text_delta, reason, o.num_prompt_tokens,
                         o.num_cached_tokens, lps)

    @staticmethod
    def _pin(engine: Any, system_prompt: str) -> None:
        """Pin the templated tokens every conversation that opens with this system prompt shares."""
        a, b = (engine.apply_chat_template([{"role": "system", "content": system_prompt},
                                            {"role": "user", "content": u}]) for u in ("a", "b"))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        engine.pin_prefix(list(a[:n]))
        log.info("pinned a system prompt prefix of %d tokens", n)


def _yield_to_the_engine() -> None:
    """The tokenizer thread runs at a lower CPU priority than the engine thread (Linux sets niceness per thread):
    on a busy host, streams that are running come before prompts still being tokenized, as in the scheduler."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: same priority, still off the engine thread
        pass
