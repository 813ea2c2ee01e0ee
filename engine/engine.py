"""`LLMEngine`: add requests, step the scheduler/model loop, stream per-request deltas.

Single-threaded by contract: every call comes from the one engine thread. The step loop is
`batch = scheduler.schedule(); tokens = runner.run(batch); scheduler.postprocess(batch)`.
"""
from __future__ import annotations

import itertools
import logging
import time
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import sluice_kernels as kernels
from engine import loader, structured
from engine.block_manager import BlockManager
from engine.config import EngineConfig, default_model_dir, kernel_cache_dir, sluice_home
from engine.cuda_graphs import graph_sizes
from engine.detokenizer import IncrementalDetokenizer
from engine.layout import Layout, placement, plan_layout
from engine.model_runner import ModelRunner
from engine.models import LlamaModel
from engine.parallel import Shard, Workers
from engine.prefix_store import PrefixStore
from engine.processor import InputProcessor
from engine.request import (PLACEHOLDER, Checkpoint, CompletionOutput, InvalidSamplingParam, PromptTooLongError,
                            Request, RequestOutput, SamplingParams, Status)
from engine.sampler import SeededStream
from engine.scheduler import Batch, Scheduler
from engine.structured import COMPILE_TIMEOUT_S, SYNC_COMPILE_S, Grammars
from engine.step_cost import attention_work

log = logging.getLogger("sluice.engine")


class StepError(RuntimeError):
    """A step failed; its requests were aborted and freed (they are not reported again). `outputs`: what came out
    for them before it failed, in this step (`async_output_proc` makes the last step's outputs then): report them
    before the failure."""

    def __init__(self, request_ids: list[str], cause: BaseException, outputs: list[RequestOutput] | None = None):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        self.cause = cause
        self.outputs = outputs or []


class DeviceError(RuntimeError):
    """The device failed for every request of a step, and then for a trivial computation: the engine cannot go on
    (a CUDA error poisons its context). Its requests are intact; a caller can resume them in a new engine."""


class LLMEngine:
    def __init__(self, config: EngineConfig, *, model: LlamaModel | None = None, layout: Layout | None = None,
                 kv_caches: list | None = None, draft_model: LlamaModel | None = None):
        """`model`, `layout`, `kv_caches`: the weights, KV layout and KV pool of an engine this one replaces
        (`rebuilt`)."""
        self.config = config
        self.model_dir = model_dir = default_model_dir() if config.model is None else Path(config.model)
        self.model_name = model_dir.name
        self.device, self.dtype = placement(config)
        self.model_config = mc = loader.load_model_config(model_dir)
        self.sampling_defaults = loader.sampling_defaults(model_dir, config.generation_config,
                                                          config.override_generation_config)
        try:  # (a value SamplingParams refuses fails here, at start, not in every request)
            SamplingParams(**self.sampling_defaults)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the generation config's sampling defaults {self.sampling_defaults}: {e}") from None
        if self.sampling_defaults:
            log.info("sampling defaults from the generation config (as vLLM's; --generation-config vllm: none): %s",
                     self.sampling_defaults)
        shard = Shard.plan(mc, 0, config.tensor_parallel_size)  # a size that cannot split is refused here, first
        # the other ranks load their shards while this one loads its own
        self.workers = None if shard.world == 1 else Workers(config, model_dir, self.device, self.dtype)
        try:
            self._build(model, layout, kv_caches, shard, draft_model)
        except BaseException:
            self.close()  # no rank outlives an engine that could not start
            raise
        self.requests: dict[str, Request] = {}
        self._compiling: dict[str, Request] = {}  # structured output's, until their grammars compile
        self._aborted: list[RequestOutput] = []
        # async_scheduling: the step launched last, its tokens not committed yet (while the next one is scheduled)
        self._pipelined = self._schedules_ahead()
        self._inflight: _InFlight | None = None
        # async_output_proc: the thread forwards run on, and the last step's outputs, made while the next one runs
        # (scheduling ahead makes them so anyway: its plain steps, under speculation, make their own at once)
        self._defers = self._overlaps() and not self._pipelined
        self._forwards = _ForwardThread() if self._pipelined or self._defers else None
        if self._forwards is not None:  # an engine let go without close() stops its thread too
            weakref.finalize(self, self._forwards.stop)
        self._pending: list[_Emit | RequestOutput] = []
        self._ids = itertools.count()
        self.num_steps = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        layout = self.layout
        log.info(
            "engine ready: model=%s device=%s dtype=%s kv_cache_dtype=%s kv_blocks=%d host_kv_blocks=%d block_size=%d "
            "max_model_len=%d attention=%s", self.model_name, self.device, self.dtype,
            str(layout.cache_dtype).removeprefix("torch."), layout.num_blocks, layout.num_host_blocks,
            layout.block_size, layout.max_model_len, self.attention_backend,
        )

    def _build(self, model: LlamaModel | None, layout: Layout | None, kv_caches: list | None, shard: Shard,
               draft_model: LlamaModel | None = None) -> None:
        config, mc, model_dir = self.config, self.model_config, self.model_dir
        self.model = model or LlamaModel(mc, loader.Weights(model_dir), self.device, self.dtype, shard)
        if self.workers is not None:
            self.workers.join()
        self.draft_model = draft_model or self._load_draft()
        # after the weights (CUDA sizing)
        self.layout = layout = layout or plan_layout(config, mc, self.device, self.dtype,
                                                     self.draft_model.cfg if self.draft_model else None)
        if self.draft_model is not None and self.draft_model.cfg.max_position_embeddings < layout.max_model_len:
            raise ValueError(f"the draft model's context ({self.draft_model.cfg.max_position_embeddings} positions) is "
                             f"shorter than max_model_len ({layout.max_model_len}): lower max_model_len")
        if self.workers is not None:
            self.workers.send_layout(layout.num_blocks, layout.block_size, layout.max_model_len)
        self.max_model_len = layout.max_model_len
        self.processor = InputProcessor(model_dir, mc.vocab_size, layout.max_model_len, config.chat_template)
        self.tokenizer = self.processor.tokenizer
        # `bad_words` lists as token ids, the latest 64: a request's n choices and batch prompts share one (each was
        # tokenized again: a batch of 1,024 prompts with 256 long words held the engine thread for ~100 s)
        self._bad_words: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()
        self.eos_token_ids = loader.eos_token_ids(model_dir, self.tokenizer)
        self.block_manager = BlockManager(layout.num_blocks, layout.block_size, config.enable_prefix_caching,
                                          layout.num_host_blocks, config.kv_eviction)
        self.scheduler = Scheduler(config, self.block_manager, layout.max_model_len, mc.vocab_size)
        self.runner = ModelRunner(self.model, layout=layout, max_num_tokens=self.scheduler.whole_prompt_budget,
                                  max_num_seqs=config.max_num_seqs, seed=config.seed, kv_caches=kv_caches,
                                  workers=self.workers, draft_model=self.draft_model, graph_sizes=self._graph_sizes())
        if self.device.type == "cpu" and kernels.MODE == "auto":
            kernels.cpu.load(kernel_cache_dir())  # the native CPU kernels; the torch twins if that fails
        self.attention_backend = kernels.attention_backend(self.device, self.dtype, layout.cache_dtype)

    def _overlaps(self) -> bool:
        """Does this engine make a step's outputs while the next step's forward runs (`async_output_proc`)?"""
        if not self.config.async_output_proc:
            return False
        if self.workers is not None:
            # NOTE: the other ranks' collectives would run on the forward thread: not tried yet
            log.warning("async_output_proc does not run with tensor parallelism yet; outputs are made in the step")
            return False
        return True

    def _schedules_ahead(self) -> bool:
        """Does this engine schedule and launch step N+1 before step N's tokens are committed (`async_scheduling`)?"""
        if not self.config.async_scheduling:
            return False
        if self.workers is not None:
            # NOTE: other ranks' collectives would run on the forward thread: not built
            log.warning("async_scheduling does not run with tensor parallelism; it is off")
            return False
        return True

    def _graph_sizes(self) -> tuple[list[int], list[int]] | None:
        """The buckets steps are captured at in CUDA graphs (`enforce_eager=False`): (decode batch sizes, mixed
        token counts: none under `cudagraph_mode="full_decode_only"`), or None."""
        if self.config.enforce_eager:
            return None
        if self.device.type != "cuda" or self.workers is not None:
            # NOTE: a tensor-parallel forward all-reduces over NCCL: not captured yet
            log.warning("enforce_eager=False: CUDA graphs need a CUDA device and one rank; running eagerly")
            return None
        if kernels.attention_backend(self.device, self.dtype, self.layout.cache_dtype) != "triton":
            # the torch twins read device values on the host (`.tolist()`, boolean masks): no capture survives that
            log.warning("enforce_eager=False: CUDA graphs need the Triton kernels (SLUICE_KERNELS=torch); running eagerly")
            return None
        return graph_sizes(self.config)

    def _load_draft(self) -> LlamaModel | None:
        """Speculative decoding's draft model (`speculative="draft:DIR"`): any llama-family model whose tokenizer has
        the target's vocabulary (its token ids must mean the same)."""
        path = self.config.draft_model
        if path is None:
            return None
        dmc = loader.load_model_config(Path(path))
        target = loader.load_tokenizer(self.model_dir).get_vocab()
        if loader.load_tokenizer(Path(path)).get_vocab() != target or dmc.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"the draft model {path} has another vocabulary than {self.model_dir}: its token ids "
                             "would not mean the same")
        return LlamaModel(dmc, loader.Weights(Path(path)), self.device, self.dtype)

    # -- requests --------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.processor.chat_ids(messages)

    def rebuilt(self, keep_cache: bool = False) -> LLMEngine:
        """A new engine over this one's weights (on the same device): a new scheduler, and an empty KV pool and
        prefix cache, or with `keep_cache` this engine's pool and the blocks its prefix cache holds (when its KV
        can be trusted: this engine failed outside the model, and nothing runs on it any more). For resuming
        requests (`add_request(..., resume=)`) after this engine failed: with the cache kept, a request finds its
        prompt and given tokens' full blocks there. Its counters go on from this one's, so a process's counters
        (`/metrics`) never go back. Its KV layout is this one's (same blocks, same `max_model_len`: what the
        checkpoints were made under). Pools not kept are let go first (a step still running on them keeps them
        until it returns), so the new ones can take their memory."""
        if self.workers is not None:
            raise RuntimeError("a tensor-parallel engine is not rebuilt over its old ranks: start the server again")
        kept = self.runner.kv_caches if keep_cache and self.config.enable_prefix_caching else None
        if kept is not None and self._forwards is not None:
            # NOTE: with async scheduling a step (its copies, forward, sampling) may still be queued when the engine
            # failed: it writes the pool the new engine keeps, so it ends first (a kept pool's engine is not stuck)
            self._forwards.submit(lambda: None).exception()
        if self._forwards is not None:  # its forward thread; one stuck in a forward keeps running, on the old pool
            self._forwards.stop(wait=False)
        self.runner.kv_caches, self.runner.host_caches, self.runner.draft_caches = [], [], []
        self.runner.graphs = None  # its graphs read the old pool: the new runner captures its own
        if self.device.type == "cuda" and kept is None:
            torch.cuda.empty_cache()  # else the allocator keeps the old pool reserved
        new = LLMEngine(self.config, model=self.model, layout=self.layout, kv_caches=kept, draft_model=self.draft_model)
        if kept is not None:
            new.block_manager.adopt_cache(self.block_manager)
        new.go_on_from(self.stats())
        if new.scheduler.spec and self.scheduler.spec:
            new.scheduler.spec.num_steps = self.scheduler.spec.num_steps  # (not a stat: the adaptive cap's)
        return new

    def go_on_from(self, stats: Mapping[str, Any]) -> None:
        """Its counters go on from another engine's (that one's `stats()`), which it replaces: `rebuilt`, and an
        engine process started after one that failed (service/engine_process.py), so that a server's counters
        (`/metrics`) never go back."""
        bm, spec = self.block_manager, self.scheduler.spec
        self.num_steps, self.prompt_tokens_computed, self.generation_tokens = (
            stats["num_steps"], stats["prompt_tokens_computed"], stats["generation_tokens"])
        self.scheduler.num_preemptions = stats["num_preemptions"]
        self.scheduler.num_fair_preemptions = stats["fair_preemptions"]
        self.scheduler.num_deferred_decodes = stats["deferred_decodes"]
        self.scheduler.pressure.go_on_from(stats["num_preemptions"], stats["scheduler_mode_changes"])
        for counter in ("prefix_cache_queries", "prefix_cache_hits", "host_cache_hits", "host_blocks_offloaded",
                        "host_blocks_loaded"):
            setattr(bm, counter, stats[counter])
        self.runner.copy_seconds = stats["host_copy_seconds"]
        if spec:
            spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_declined = (
                stats["spec_draft_tokens"], stats["spec_accepted_tokens"], stats["spec_declined_steps"])
        if bm.host:
            bm.host.evictions = stats["host_cache_evictions"]

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        key = tuple(words)
        if (seqs := self._bad_words.pop(key, None)) is None:
            seqs = self.processor.bad_words_ids(words)
        self._bad_words[key] = seqs
        if len(self._bad_words) > 64:
            self._bad_words.popitem(last=False)
        return seqs

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *, fit_max_tokens: bool = True,
        resume: Checkpoint | None = None, add_special_tokens: bool = True, client: Hashable = None,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> None:
        """Raises `PromptTooLongError` if the prompt leaves no room for a token, `ValueError` if it is bad.

        `params.max_tokens` None asks for all the context the prompt leaves. One larger than that is capped
        with `fit_max_tokens`, else refused (`PromptTooLongError`). A str is tokenized here, on the engine
        thread; a server tokenizes on its own thread and passes ids. `resume`: the request ran in another engine
        (same model and config) and its caller has what the checkpoint holds; it goes on from there, its outputs
        recomputed as a preempted request's are, and what comes out next is what that engine would have sent.
        `add_special_tokens`: a str prompt is tokenized with the special tokens its tokenizer adds to a text (a BOS),
        as Hugging Face's tokenizers and vLLM do. `client`: who asks (a server's peer address; None: the one client);
        requests of several clients share the running seats (engine/scheduler.py). `bad_words_token_ids`:
        `params.bad_words` as `InputProcessor.bad_words_ids` makes them, made by the caller (a server's tokenizer
        thread), so this thread does not tokenize them."""
        params = params or self.default_sampling_params()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.processor.prompt_ids(prompt, chat=False, add_special_tokens=add_special_tokens)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room and not fit_max_tokens:
            raise PromptTooLongError(f"the context is {self.max_model_len} tokens; the prompt has {len(ids)} and "
                                     f"max_tokens asks for {params.max_tokens} more (at most {room} fit)", "max_tokens")
        req = Request(request_id, ids, params, min(max_tokens, room), client)
        req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output)
        vocab = self.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):  # (their ids: SamplingParams checked all else)
            if (ids := getattr(params, name)) and (top := max(ids)) >= vocab:
                raise InvalidSamplingParam(name, f"{name}: token id {top} is not in the vocabulary (0..{vocab - 1})")
        if params.min_tokens:
            banned = set(params.stop_token_ids) | self.eos_token_ids  # (as vLLM: EOS even when ignored)
            req.min_tokens_banned = sorted(t for t in banned if 0 <= t < vocab) or None
            ban = req.min_tokens_banned
            if ban is not None and (len(ban) == vocab if params.allowed_token_ids is None
                                    else set(params.allowed_token_ids) <= set(ban)):
                raise InvalidSamplingParam("min_tokens", "min_tokens: every token that may be sampled ends the request "
                                           "(stop_token_ids, EOS), so none could come before the minimum")
        rows = self.scheduler.prompt_logprob_rows
        if params.prompt_logprobs is not None and self.config.scheduling != "mixed" and req.num_prompt_tokens > rows:
            raise InvalidSamplingParam("prompt_logprobs", f"prompt_logprobs: under --scheduling "  # (its logits at once)
                                       f"{self.config.scheduling} a prompt is computed whole, its logits at once: at "
                                       f"most {rows} tokens (this one has {req.num_prompt_tokens}); mixed computes a "
                                       "longer one in chunks")
        compiling = params.structured_output is not None and not self._grammar(req)
        try:
            if params.bad_words:
                if bad_words_token_ids is None:
                    bad_words_token_ids = self._bad_words_ids(params.bad_words)
                for ids in bad_words_token_ids:
                    if len(ids) == 1:
                        req.bad_tokens.append(ids[0])
                    else:
                        req.bad_sequences.append(ids)
            if params.seed is not None:
                req.generator = self.runner.sampler.make_generator(params.seed)
            if resume is not None:
                _resume(req, resume)
                if req.matcher is not None:
                    _replay_grammar(req, self.runner.sampler.grammars)
        except BaseException:
            if compiling:  # (refused: it waits for its compile no more)
                self.runner.sampler.grammars.release(req.grammar)
            raise
        self.requests[request_id] = req
        if compiling:  # scheduled once its grammar is compiled (`_admit_compiled`)
            self._compiling[request_id] = req
        else:
            self.scheduler.add(req)

    def _grammar(self, req: Request) -> bool:
        """Starts compiling `req`'s structured output (engine/structured.py) and gives it its matcher if that takes
        under SYNC_COMPILE_S; False if it is still compiling (`req.grammar`). `InvalidSamplingParam` naming its field
        if it cannot be compiled (within that wait), or if another parameter could leave it no token to draw."""
        so, params = req.params.structured_output, req.params
        assert so is not None
        for name, clash in (("min_tokens", params.min_tokens > 0), ("allowed_token_ids", params.allowed_token_ids)):
            if clash:  # (both keep tokens out: the grammar's next one, its end say, could be among them)
                raise InvalidSamplingParam(so.param, f"{so.param}: structured output cannot be combined with {name}")
        if self.runner.sampler.grammars is None:
            self.runner.sampler.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        grammars = self.runner.sampler.grammars
        req.grammar = grammars.compile(so, req.client)
        try:
            grammars.start(req, req.grammar.result(timeout=SYNC_COMPILE_S))
        except TimeoutError:
            return False
        except ValueError as e:
            raise InvalidSamplingParam(so.param, f"{so.param}: {e}") from None
        finally:
            if req.grammar.done():
                grammars.release(req.grammar)
        req.grammar = None
        return True

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Schedules the requests whose grammars are now compiled (their matchers where their checkpoint left them);
        one that cannot be compiled, or is still compiling after COMPILE_TIMEOUT_S, is refused (an output whose
        `error_param` names its field)."""
        if not self._compiling:
            return
        now = time.monotonic()
        grammars = self.runner.sampler.grammars
        for rid, req in list(self._compiling.items()):
            so = req.params.structured_output
            started = getattr(req.grammar, "started", None)  # (set by the compile thread once it takes it)
            if not req.grammar.done() and (started is None or now - started < COMPILE_TIMEOUT_S):
                continue
            del self._compiling[rid]
            grammars.release(req.grammar)
            try:
                if not req.grammar.done():
                    raise ValueError(f"still compiling after {COMPILE_TIMEOUT_S:g} s: too complex to follow")
                grammars.start(req, req.grammar.result())
                _replay_grammar(req, grammars)
            except Exception as e:
                log.info("request %s refused: %s: %s", rid, so.param, e)
                self.requests.pop(rid, None)
                req.status = Status.FINISHED
                out = self._output(req, [], "", "abort")
                out.error, out.error_param = f"{so.param}: {e}", so.param
                outputs.append(out)
                continue
            req.grammar = None
            self.scheduler.add(req)

    def _idle(self) -> None:
        """Nothing ran this step and nothing is to be handed back: if a request waits for its grammar's work
        (engine/structured.py: its compile, or its next mask), waits a little for it (not a busy loop)."""
        pending = [r.grammar for r in self._compiling.values()] + [
            r.mask for q in (self.scheduler.running, self.scheduler.waiting) for r in q
            if r.mask is not None and not r.mask.done()]  # (waiting: preempted while its mask was being made)
        if pending:
            futures.wait(pending, timeout=0.01, return_when=futures.FIRST_COMPLETED)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if self._compiling.pop(request_id, None) is not None:  # (never scheduled)
            self.runner.sampler.grammars.release(req.grammar)  # (its compile, if no one else waits for it, dropped)
            req.status = Status.FINISHED
            self._aborted.append(self._output(req, [], "", "abort"))
            return
        self.scheduler.finish(req, "abort")
        made = self._emit_pending()  # what it made before, first (async_output_proc)
        self._aborted += made
        if not any(o.request_id == request_id and o.finished for o in made):  # (its output failed it already)
            self._aborted.append(self._output(req, [], "", None))

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._pending)
                or self._inflight is not None or bool(self._compiling))

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        self._admit_compiled(outputs)
        try:
            return self._step_ahead(outputs) if self._pipelined else self._step(outputs)
        except StepError:
            raise  # `_recover` kept the outputs already
        except BaseException:
            # NOTE: aborts taken before the failure, and outputs made before it, are reported by the next step:
            # their requests have left `self.requests`, so nobody else would ever report them
            self._aborted = outputs + self._aborted + self._emit_pending()
            raise

    def _step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        started = time.perf_counter()  # a step's whole time is a running stream's inter-token latency
        batch = self.scheduler.schedule(graphs=self.runner.graphs)
        copy_s = self._copy_blocks()  # the host tier's copies this batch's allocations decided, before its forward
        if not batch:
            if not (outputs := outputs + self._emit_pending()):
                self._idle()
            return outputs
        samples = batch.samples()
        spec = self.scheduler.spec
        timed = self.config.itl_slo_ms is not None or spec is not None  # the step-cost model wants this step
        if timed:  # what it needs of the step, before commit: the rest decode, some of them with a draft
            cost_x = _cost_features(batch, samples, self.runner)
            drafting = [r for r in batch.reqs if r.draft]  # (the scheduler's drafts: cleared as outputs are made)
            drafts = sum(len(r.draft) for r in drafting)
        rng = self._rng_state(batch)
        try:
            if self._forwards is None:
                tokens, logprobs = self.runner.run(batch, samples)  # returns host lists: the device is done
            else:
                tokens, logprobs = self._run_overlapped(batch, samples, outputs)
        except Exception as e:  # the model failed: find whose computation fails, fail only those, keep serving
            tokens, logprobs = self._recover(batch, samples, rng, e, outputs)
        self._count_prompt_tokens(batch)
        self.scheduler.postprocess(batch)
        self.num_steps += 1
        made: list[_Emit | RequestOutput] = []
        try:
            self._commit(batch, samples, tokens, logprobs, made)
        finally:  # what was committed is reported, whatever fails after it
            if self._defers:
                self._pending = made  # made while the next step runs
            else:
                outputs += [m if isinstance(m, RequestOutput) else self._emit_or_fail(m) for m in made]
        if timed:
            # NOTE: without the host tier's copies, which the model does not know (they scale with hits, not tokens),
            # and without the draft model's time, which speculation's own model learns
            forwards, tokens, draft_s = self.runner.draft_work
            seconds = time.perf_counter() - started - copy_s - draft_s
            if drafting:  # what the drafts added to a plain step's time
                spec.observe_step(self.scheduler.step_cost.predict(*cost_x), seconds, drafts, len(drafting),
                                  forwards, tokens, draft_s)
            else:
                self.scheduler.step_cost.observe(*cost_x, seconds)
        return outputs

    # -- async scheduling ------------------------------------------------------------------
    # Step N+1 is scheduled and launched while step N runs: step N's sampled tokens are in its requests as
    # placeholders (`Request.num_placeholders`), its computed tokens counted (not yet published in the prefix cache),
    # and step N+1's forward reads those tokens on the device, after step N's sampling (the forward thread runs
    # jobs in order). Then step N's tokens come to the host and are committed, and its outputs made, while step N+1's
    # forward runs. Step N+1's sampling is queued at the start of the step after (`_sample`), after that commit and
    # any abort or failure between the two, so penalties, stops and seeds see what the plain loop shows them.

    def _step_ahead(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        started = time.perf_counter()
        spec = self.scheduler.spec
        if spec is not None and spec.enabled_for(len(self.scheduler.running)):
            # the step may draft, and a draft is built from the last token's value on the host: the step in flight
            # is committed first, and this one runs as the plain loop's (speculation where batches are small,
            # scheduling ahead where they are large enough to turn it off)
            last, self._inflight = self._inflight, None
            if last is not None:
                if last.result is None:
                    self._sample(last)
                last.cost_x = None  # (waited for now, not a period of the loop: no step time to learn from)
                if not self._finish(last, None, outputs, started):
                    return outputs  # (it failed and was run again: that was this step)
            return self._step(outputs)
        last, self._inflight = self._inflight, None
        try:
            if last is not None and last.result is None:
                self._sample(last)
            # (no drafts: a draft would read the placeholders)
            batch = self.scheduler.schedule(drafts=False, graphs=self.runner.graphs)
            offloads, loads = self.block_manager.take_copies()
            copies = None
            if offloads or loads:  # on the forward thread: after the running step, which may write those blocks
                copies = self._forwards.submit(lambda: _copy(self.runner, offloads, loads))
            forward, samples = None, []
            if batch:
                samples = batch.samples()
                ahead = {} if last is None else last.rows
                placeholders = {i: ahead[r] for i, (r, n) in enumerate(zip(batch.reqs, batch.num_new_tokens))
                                if r.num_placeholders and r.num_computed_tokens + n == r.num_tokens}
                forward = self._forwards.submit(self.runner.launch(batch, samples, placeholders))
        except BaseException:
            self._inflight = last  # the next step commits it
            raise
        if copies is not None and copies.exception() is not None:  # (a `DeviceError`: the engine is done)
            if forward is not None:
                forward.exception()
            raise copies.exception()
        if last is not None:
            try:
                ok = self._finish(last, forward, outputs, started)
            except BaseException:
                if forward is not None:
                    forward.exception()  # launched on tokens never sampled: it ran for nothing
                self.scheduler.unadmit(batch)
                raise
            if not ok:  # the last step failed and was run again: this one read none of its tokens (and waited)
                self.scheduler.unadmit(batch)
                return outputs
        if not batch:
            if not outputs:
                self._idle()
            return outputs
        f = _InFlight(batch, samples, launched=[i for i, s in enumerate(samples) if s])
        if self.config.itl_slo_ms is not None or spec is not None:  # before the step counts its tokens
            f.cost_x = _cost_features(batch, samples, self.runner)
        for r, n, s in zip(batch.reqs, batch.num_new_tokens, samples):
            if r.status is not Status.RUNNING:
                continue
            f.prompt_tokens += _prompt_tokens(r, n)
            self.block_manager.advance(r, n)
            f.advanced.append((r, n))
            if s:
                r.token_ids.append(PLACEHOLDER)
                r.num_placeholders += 1
                f.placed.append(r)
            f.tables[r] = r.block_table
        f.forward = forward
        self._inflight = f
        return outputs

    def _sample(self, f: _InFlight) -> None:
        """Queues a launched step's sampling behind its forward, at the start of the step after it: requests that
        ended since it was launched (the last commit, `abort()`, `fail()`) are not sampled, as the plain loop would
        not have run them (an unseeded draw would move every other request's)."""
        gone = _drop_finished(f.batch, f.samples)
        keep = _kept_rows(f.batch, f.launched, gone) if gone else None
        f.rows = {r: j for j, r in enumerate(r for r, s in zip(f.batch.reqs, f.samples) if s)}
        f.rng = self._rng_state(f.batch)  # (no sampling runs now: the last one was waited for)
        batch, samples, forward = f.batch, f.samples, f.forward

        def sample() -> tuple[list, list]:
            self.runner.sampled = None  # if this fails, the next forward finds no tokens to read, not old ones
            logits = forward.result()
            return self.runner.sample(batch, samples, logits if keep is None else logits[keep])

        f.result = self._forwards.submit(sample)

    def _finish(self, f: _InFlight, after: Future | None, outputs: list[RequestOutput], started: float) -> bool:
        """Waits for a launched step's tokens, commits them, makes their outputs into `outputs`. False if the step
        failed: then it is undone and run again as the plain loop recovers a step (`_recover`, which may raise
        `StepError`), and the step launched `after` it, which read its tokens, is to be dropped."""
        try:
            tokens, logprobs = f.result.result()
            ok = True
        except Exception as e:
            if after is not None:
                after.exception()  # the forward thread is idle before the step runs again on this one
            self._undo(f)
            # run again without the requests the next step's scheduling preempted (maybe readmitted): nothing of
            # theirs is computed any more, and the waiting queue brings them back
            rows = [i for i, r in enumerate(f.batch.reqs) if f.tables.get(r) is r.block_table]
            f.batch, f.samples = _subset(f.batch, rows), [f.samples[i] for i in rows]
            tokens, logprobs = self._recover(f.batch, f.samples, f.rng, e, outputs)
            self._count_prompt_tokens(f.batch)
            self.scheduler.postprocess(f.batch)
            ok = False
        if ok:
            f.unplace()  # `_commit` appends the tokens
            for r, _ in f.advanced:
                if r.status is Status.RUNNING:
                    self.block_manager.publish(r)
            self.prompt_tokens_computed += f.prompt_tokens
        self.num_steps += 1
        made: list[_Emit | RequestOutput] = []
        try:
            self._commit(f.batch, f.samples, tokens, logprobs, made)
        finally:
            outputs += [m if isinstance(m, RequestOutput) else self._emit_or_fail(m) for m in made]
        if f.cost_x is not None:  # the step's time: the loop's period, one step's launch to the next's
            self.scheduler.step_cost.observe(*f.cost_x, time.perf_counter() - started)
        return ok

    def _undo(self, f: _InFlight) -> None:
        """A launched step that failed: its requests back where it found them (its computed tokens not counted, no
        placeholder), so it can run again."""
        for r, n in f.advanced:
            if f.tables[r] is r.block_table:  # (preempted meanwhile, maybe readmitted: its count is another's)
                self.block_manager.advance(r, -n)
        f.unplace()

    # -- when the model fails ----------------------------------------------------------------
    # Nothing of a step is kept until `scheduler.postprocess` commits it: a request the failed step held still
    # has its last committed state (computed tokens, blocks, outputs), so re-running it is safe. Only the
    # random generators move during a run; they are put back before every retry and probe, so requests that
    # are not to blame sample exactly what they would have without the failure.

    def _rng_state(self, batch: Batch) -> list[tuple[torch.Generator | SeededStream, Any]]:
        gens = [self.runner.sampler.generator, *(r.generator for r in batch.reqs if r.generator is not None)]
        return [(g, g.get_state()) for g in gens]

    def _commit(self, batch: Batch, samples: list[bool], tokens: list, logprobs: list, made: list) -> None:
        """The step's results into its requests, each request's output (or what makes it: `_Emit`) into `made`."""
        j = 0
        for req, sampled in zip(batch.reqs, samples):
            if req.status is not Status.FINISHED:  # (else it failed while this step ran: its tokens go)
                try:
                    if sampled:
                        made.append(self._append_tokens(req, tokens[j], logprobs[j]))
                    elif not req.announced:  # first chunk of a long prompt: tell the caller it started
                        made.append(self._output(req, [], "", None))
                    req.announced = True
                except Exception as e:  # this request's output cannot be made (its detokenizer, say): it fails alone
                    made.append(self.fail(req.request_id, e))
            j += sampled
            req.draft = []

    def _run_overlapped(self, batch: Batch, samples: list[bool],
                        outputs: list[RequestOutput]) -> tuple[list[list[int]], list]:
        """`runner.run` with the last step's outputs made while the forward runs on the forward thread: everything
        the forward reads of the requests is read before it starts (`runner.launch`), and the sampler, which reads
        their generators and tokens, runs after the outputs are made."""
        try:
            forward = self._forwards.submit(self.runner.launch(batch, samples))
        except BaseException:
            outputs += self._emit_pending()  # the last step's outputs, made anyway: a retry will hold back its own
            raise
        try:
            outputs += self._emit_pending()
        finally:
            forward.exception()  # NOTE: whatever happened here, the forward is done before anything else runs
        logits = forward.result()
        launched = [i for i, s in enumerate(samples) if s]
        if gone := _drop_finished(batch, samples):
            # failed while it ran: not sampled (an unseeded draw would move every other request's)
            logits = logits[_kept_rows(batch, launched, gone)]
        # NOTE: on the forward thread too: torch's CPU ops keep a pool of OpenMP threads per calling thread, and with
        # the sampler on the engine thread (a second pool) the forward ran 28% slower at batch 64 on two cores
        return self._forwards.submit(lambda: self.runner.sample(batch, samples, logits)).result()

    def _recover(self, batch: Batch, samples: list[bool], rng: list[tuple[torch.Generator | SeededStream, torch.Tensor]],
                 error: Exception, outputs: list[RequestOutput]) -> tuple[list[int], list]:
        """The step failed. Retry it once (a transient failure: the retry's result stands); else run its requests
        in halves, outputs discarded, down to those that fail alone, and drop only them (`StepError`). The rest
        are not committed and run again from the next step. If no request fails alone, all of them are dropped."""
        _drop_finished(batch, samples)  # in place: the step's loop then skips their rows of the result
        admitted = batch  # (its admissions, whatever it runs again)
        keep = [i for i, r in enumerate(batch.reqs) if r.status is Status.RUNNING]
        if len(keep) < len(batch):  # some failed (`_emit_pending`) or were preempted (async scheduling) meanwhile
            if not keep:  # nothing of it is left to run
                return [], []
            batch, samples = _subset(batch, keep), [samples[i] for i in keep]
        ids = [r.request_id for r in batch.reqs]
        if self.workers is not None:  # its ranks may be anywhere in that forward: another collective would hang
            raise DeviceError(f"a tensor-parallel step failed ({error!r}); its ranks are out of step") from error
        log.warning("step failed (%s: %s); retrying its %d requests", type(error).__name__, error, len(ids))
        _restore(rng)
        try:
            return self.runner.run(batch, samples)
        except Exception:
            pass
        culprits = self._culprits(batch, samples, list(range(len(batch))), rng) or list(batch.reqs)  # together: all
        _restore(rng)
        if len(culprits) == len(batch) and not self.runner.device_ok():  # no request is to blame
            raise DeviceError(f"the device fails every computation ({error!r}); this engine cannot go on") from error
        bad = [r.request_id for r in culprits]
        log.error("step failed for requests %s (of %s); aborting them", bad, ids, exc_info=error)
        for r in culprits:
            self.requests.pop(r.request_id, None)
            self.scheduler.finish(r, "abort")
        for r in batch.reqs:  # the others run again from the next step, which drafts anew
            if r.draft and r.status is Status.RUNNING:
                r.draft = []
                self.block_manager.trim(r)
        # NOTE: the others' prompts admitted in it go back to the waiting queue, to be admitted again: under
        # prefill_first and static a prompt is computed only in the step that admits it, and a running one whose
        # prompt is not computed would never be scheduled (it hung, holding its blocks)
        self.scheduler.unadmit(admitted)
        # aborts taken for this step, and other requests' outputs made in it, are reported by the next one
        self._aborted = [o for o in outputs if o.request_id not in bad] + self._aborted
        raise StepError(bad, error, [o for o in outputs if o.request_id in bad]) from error

    def _culprits(self, batch: Batch, samples: list[bool], rows: list[int],
                  rng: list[tuple[torch.Generator | SeededStream, torch.Tensor]]) -> list[Request]:
        """The requests among `rows` (which fail together) whose computation fails alone, found by halving."""
        found: list[Request] = []
        for half in (rows[: len(rows) // 2], rows[len(rows) // 2 :]):
            if not half:
                continue
            probe = _subset(batch, half)
            _restore(rng)
            try:
                self.runner.run(probe, [samples[i] for i in half])
            except Exception:
                # NOTE: a part that fails while none of its halves does is blamed whole: every failure drops someone
                inner = self._culprits(batch, samples, half, rng) if len(half) > 1 else []
                found += inner or [batch.reqs[i] for i in half]
        return found

    def _copy_blocks(self) -> float:
        """Makes the copies the block manager decided; returns the seconds they took."""
        offloads, loads = self.block_manager.take_copies()
        if not (offloads or loads):
            return 0.0
        before = self.runner.copy_seconds
        _copy(self.runner, offloads, loads)
        return self.runner.copy_seconds - before

    def _count_prompt_tokens(self, batch: Batch) -> None:
        for r, n in zip(batch.reqs, batch.num_new_tokens):
            # (a decode computes none; a request that failed or was preempted while its step ran has no blocks)
            if r.num_computed_tokens < r.num_prompt_tokens and r.status is Status.RUNNING:
                self.prompt_tokens_computed += _prompt_tokens(r, n)

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: list | None) -> _Emit:
        """A step's new tokens for `req` (more than one when verification kept draft tokens), in order, until one
        finishes it. Everything that decides what runs next happens here: token ids, stops, the finish, and then
        the kept draft tokens' KV is committed (the step computed it) and blocks that held only rejected ones go
        back. Its output, one for them all, is `_emit`'s (at once, or with `async_output_proc` while the next step
        runs): only a request with stop strings needs its text here, where it decides the finish."""
        p, e = req.params, _Emit(req)
        if req.matcher is not None and req.mask_s >= structured.MASK_LIMIT_S:  # (it fails: `_commit`)
            so = p.structured_output
            raise InvalidSamplingParam(so.param, f"{so.param}: too costly to follow: the choice of a token took "
                                       f"{req.mask_s:.1f} s (at most {structured.MASK_LIMIT_S:g} s); simplify it")
        for i, token in enumerate(tokens):
            stops = not p.min_tokens or not req.below_min_tokens()  # (one of the first min_tokens never ends it)
            req.token_ids.append(token)
            self.generation_tokens += 1
            e.token_ids.append(token)
            if logprobs and logprobs[i]:
                e.logprobs.append(logprobs[i])
            reason, matched_stop_string = None, False
            if req.matcher is not None:  # (a token it does not allow: this request fails, see `_commit`)
                if not req.matcher.accept_token(token):
                    raise RuntimeError(f"token {token} is not one its structured output allows")
                if req.matcher.is_terminated():  # the grammar is complete and took its end: nothing may follow
                    reason = "stop"
            if stops and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
                reason = "stop"  # the stop token itself shows up in token ids, never in text
            elif not p.stop:
                e.text_ids.append(token)  # no stop string to find: the text can wait
            elif req.detok.add_token(token, stops):
                reason, matched_stop_string = "stop", True
            if reason is None and req.reached_length(self.max_model_len):
                reason = "length"
            if reason is not None and not matched_stop_string:
                if not p.stop:
                    e.flush = True
                elif req.detok.flush(stops):
                    reason = "stop"  # the last, held-back bytes completed a stop string
            if reason is not None:
                e.reason = reason
                self.requests.pop(req.request_id, None)
                self.scheduler.finish(req, reason)
                break
        if req.matcher is not None and e.reason is None:
            self.runner.sampler.grammars.fill_later(req)
        if req.generator is not None:
            e.rng_state = req.generator.get_state()
        if req.draft:
            self.scheduler.spec.observe(req, len(req.draft), len(tokens) - 1)
            if req.status is Status.RUNNING:
                self.block_manager.commit(req, len(tokens) - 1)
                self.block_manager.trim(req)
                # the draft model computed the token before each draft token; all kept: the last one's KV it lacks
                req.num_draft_computed = req.num_computed_tokens - (len(tokens) - 1 == len(req.draft))
        return e

    def _emit(self, e: _Emit) -> RequestOutput:
        """`_append_tokens`' output: the text its tokens add (for a request without stop strings, detokenized
        now), the tokens, their logprobs."""
        req = e.req
        for token in e.text_ids:
            req.detok.add_token(token)  # no stop strings: it never ends the request
        if e.flush:
            req.detok.flush()
        out = self._output(req, e.token_ids, req.detok.delta(e.reason is not None), e.reason, e.logprobs or None)
        out.finished, out.finish_reason = e.reason is not None, e.reason  # as of its step (it may have ended since)
        if req.wants_prompt_logprobs:  # (its first token's output: every prompt chunk is computed)
            out.prompt_logprobs, req.prompt_lps_sent = list(req.prompt_lps), True  # (a copy: a recompute rewrites)
            out.prompt_token_ids = req.token_ids[: req.num_prompt_tokens]
        out.rng_state = e.rng_state
        return out

    def _emit_or_fail(self, e: _Emit) -> RequestOutput:
        try:
            return self._emit(e)
        except Exception as error:  # this request's output cannot be made (its detokenizer, say): it fails alone
            return self._failed(e.req, error)

    def _emit_pending(self) -> list[RequestOutput]:
        """The outputs `async_output_proc` held back (the last step's). One that cannot be made fails its request,
        at once if it still runs: the step in flight has its metadata already, and its blocks are freed only in
        the bookkeeping (the next step that may take them runs after this one)."""
        pending, self._pending = self._pending, []
        return [e if isinstance(e, RequestOutput) else self._emit_or_fail(e) for e in pending]

    def fail(self, request_id: str, error: BaseException) -> RequestOutput:
        """Ends a request the engine failed outside the model: aborted, its blocks freed; the output says why.
        Its output held back for the next step (`async_output_proc`) goes: the plain loop would not have run that
        step for it."""
        self._pending = [e for e in self._pending if (e.req if isinstance(e, _Emit) else e).request_id != request_id]
        return self._failed(self.requests[request_id], error)

    def _failed(self, req: Request, error: BaseException) -> RequestOutput:
        log.error("request %s failed: %r; aborting it", req.request_id, error, exc_info=error)
        self.requests.pop(req.request_id, None)
        if req.status is not Status.FINISHED:
            self.scheduler.finish(req, "abort")
        out = self._output(req, [], "", "abort")
        out.error = f"{type(error).__name__}: {error}"
        if isinstance(error, InvalidSamplingParam):  # the request's own: refused, not failed (its field named)
            out.error, out.error_param = str(error), error.param
        return out

    def _output(self, req: Request, new: list[int], text: str, reason: str | None, logprobs=None) -> RequestOutput:
        finished = reason is not None or req.status is Status.FINISHED
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new,
            text_delta=text,
            finished=finished,
            finish_reason=reason if reason is not None else ("abort" if finished else None),
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=logprobs,
        )

    # -- conveniences ----------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """`SamplingParams` with the model's generation config's defaults (`sampling_defaults`; vLLM's
        `get_default_sampling_params`): what a request without params gets."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
        *, add_special_tokens: bool = True,
    ) -> list[CompletionOutput]:
        """Runs `prompts` to completion. Drives `step()` itself: not for use beside other step() callers.
        `add_special_tokens`: as `add_request`'s."""
        params_list = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.add_request(rid, prompt, p, add_special_tokens=add_special_tokens)
        except Exception:  # all or nothing: a bad prompt leaves no orphans behind
            for rid in ids:
                self.abort(rid)
            self._aborted = [o for o in self._aborted if o.request_id not in ids]
            raise
        acc: dict[str, CompletionOutput] = {}
        texts: dict[str, list[str]] = {}  # (joined at the end: a growing string would be copied every step)
        pending = set(ids)
        while pending:
            for o in self.step():
                if o.request_id not in pending:
                    continue
                c = acc.setdefault(o.request_id, CompletionOutput(o.request_id, [], "", "", o.num_prompt_tokens, 0, None))
                c.token_ids += o.new_token_ids
                texts.setdefault(o.request_id, []).append(o.text_delta)
                c.num_cached_tokens = o.num_cached_tokens
                if o.logprobs:
                    c.logprobs = c.logprobs or []
                    c.logprobs += o.logprobs
                if o.prompt_logprobs is not None:
                    c.prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    c.finish_reason = o.finish_reason or "abort"
                    pending.discard(o.request_id)
        for rid, c in acc.items():
            c.text = "".join(texts[rid])
        return [acc[i] for i in ids]

    def pin_prefix(self, token_ids: list[int]) -> int:
        """Pins the KV of `token_ids`' full blocks; returns the tokens pinned. From the prefix store if it holds
        them (`config.prefix_store`), else computed once and then stored."""
        bm = self.block_manager
        spare = bm.num_blocks - len(bm.pinned) - bm.blocks_needed(len(token_ids))
        if spare < bm.blocks_needed(self.max_model_len):
            raise ValueError(
                f"pinning {len(token_ids)} tokens would leave {spare} KV blocks, fewer than one max_model_len "
                f"request needs ({bm.blocks_needed(self.max_model_len)}); raise num_kv_blocks"
            )
        store = self._prefix_store()
        full = len(token_ids) // bm.block_size
        if store is not None and full and (kv := store.load(token_ids, self.runner.block_shapes(full))) is not None:
            adopted = bm.adopt_pinned(token_ids)
            try:
                self._copy_blocks()  # blocks it evicted go to the host tier before they are overwritten
                fresh = [i for i, (_, is_fresh) in enumerate(adopted) if is_fresh]
                self.runner.write_blocks([adopted[i][0] for i in fresh], [part[:, fresh] for part in kv])
            except BaseException:
                bm.unpin(adopted)
                raise
            log.info("pinned %d tokens from the prefix store (%s)", full * bm.block_size, store.path(token_ids))
            return full * bm.block_size
        self.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        n = bm.pin(token_ids)
        if store is not None and full and n == full * bm.block_size:
            try:
                path = store.save(token_ids, self.runner.read_blocks([b.id for b in bm.pinned[-full:]]))
                log.info("stored the KV of %d pinned tokens in %s", n, path)
            except Exception as e:  # a full or read-only $SLUICE_HOME costs the next start a recomputation, nothing else
                log.warning("cannot write the prefix store: %s: %s", type(e).__name__, e)
        return n

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel engine and the forward thread; the engine is unusable after."""
        if getattr(self, "_forwards", None) is not None:  # (a failed __init__ closes before there is one)
            self._forwards.stop()
        if self.workers is not None:
            self.workers.close()

    def _prefix_store(self) -> PrefixStore | None:
        # NOTE: under tensor parallelism rank 0 holds only its KV heads: the store (and its files) would miss the rest
        if not (self.config.prefix_store and self.config.enable_prefix_caching) or self.workers is not None:
            return None
        return PrefixStore(sluice_home() / "prefix-store", self.model_dir, self.dtype, self.layout.cache_dtype,
                           self.block_manager.block_size)

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.running)
        for r in self.scheduler.waiting:
            assert not r.block_table, f"waiting {r} holds blocks"

    def stats(self) -> dict[str, float | int]:
        bm, spec = self.block_manager, self.scheduler.spec
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self._compiling),
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "kv_usage": 1.0 - bm.num_free_blocks / bm.num_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "fair_preemptions": self.scheduler.num_fair_preemptions,
            "deferred_decodes": self.scheduler.num_deferred_decodes,
            "prompt_budget": self.scheduler.prompt_budget,
            "num_host_kv_blocks": bm.host.num_slots if bm.host else 0,
            "num_free_host_kv_blocks": len(bm.host.free) if bm.host else 0,
            "kv_cache_bytes": bm.num_blocks * (self.runner.block_bytes + self.runner.draft_block_bytes),
            "host_kv_cache_bytes": (bm.host.num_slots if bm.host else 0) * self.runner.block_bytes,
            "host_cache_hits": bm.host_cache_hits,
            "host_blocks_offloaded": bm.host_blocks_offloaded,
            "host_blocks_loaded": bm.host_blocks_loaded,
            "host_cache_evictions": bm.host.evictions if bm.host else 0,
            "host_copy_seconds": self.runner.copy_seconds,
            "scheduler_degraded": self.scheduler.pressure.level,
            "scheduler_mode_changes": self.scheduler.pressure.num_changes,
            "num_steps": self.num_steps,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "generation_tokens": self.generation_tokens,
            "spec_draft_tokens": spec.num_draft_tokens if spec else 0,
            "spec_accepted_tokens": spec.num_accepted_tokens if spec else 0,
            "spec_declined_steps": spec.num_declined if spec else 0,
        }


def _resume(req: Request, ckpt: Checkpoint) -> None:
    """Puts a new request where its checkpoint says its caller is; `add_request` checked the prompt already."""
    out = ckpt.output_token_ids
    if len(out) >= req.max_tokens:  # it would have finished
        raise ValueError(f"a checkpoint of {len(out)} tokens leaves no room for another (max_tokens {req.max_tokens})")
    for token in out:  # the same text as the engine that made them: the detokenizer is deterministic
        stops = not req.below_min_tokens()  # (as `_append_tokens` decides it)
        req.token_ids.append(token)
        req.detok.add_token(token, stops)
    if ckpt.num_text_chars > req.detok.num_chars:
        raise ValueError(f"a checkpoint claims {ckpt.num_text_chars} characters of text; its tokens make "
                         f"{req.detok.num_chars}")
    req.detok.emitted = ckpt.num_text_chars
    if ckpt.rng_state is not None and req.generator is not None:
        req.generator.set_state(ckpt.rng_state)
    req.announced = bool(out)  # its caller saw it start (else the new engine announces it, as a new request)
    req.prompt_lps_sent = bool(out)  # (its first token's output carried its prompt's logprobs)


def _replay_grammar(req: Request, grammars: Grammars) -> None:
    """Puts a resumed request's grammar matcher where its checkpoint's tokens left it (its compile may finish after
    `_resume`)."""
    for token in req.output_token_ids:
        if not req.matcher.accept_token(token):
            raise ValueError(f"a checkpoint's token {token} is not one its structured output allows")
    if req.output_token_ids:
        grammars.fill_later(req)  # (its first mask is the grammar start's)


def _copy(runner: ModelRunner, offloads: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
    """The host tier's copies. One that fails leaves blocks counted as cached without their KV: a `DeviceError`, so
    a rebuilt engine does not keep this one's cache."""
    try:
        runner.copy_blocks(offloads, loads)
    except Exception as e:
        raise DeviceError(f"a copy between the KV pool and the host tier failed ({e!r})") from e


def _cost_features(batch: Batch, samples: list[bool], runner: ModelRunner) -> tuple[int, int, float, bool]:
    """The step-cost model's features of a step (engine/step_cost.py): its decodes, its prompt tokens, their
    attention work, and whether it runs eagerly while CUDA graphs replay others (drafts included: what they add
    beside that is speculation's to learn)."""
    chunks = [(r, n) for r, n in zip(batch.reqs, batch.num_new_tokens) if r.is_prefilling]
    return (len(batch) - len(chunks), sum(n for _, n in chunks),
            sum(attention_work(n, r.num_computed_tokens) for r, n in chunks),
            runner.graphs is not None and not runner.graphed(batch, samples))


def _prompt_tokens(req: Request, n: int) -> int:
    """How many of the `n` tokens a step computes for `req` are its prompt's."""
    return max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)


def _drop_finished(batch: Batch, samples: list[bool]) -> set[int]:
    """Clears, in place, the sample of each request of `batch` that left the running set while its step ran (a
    request that failed in `LLMEngine._emit_pending`; under async scheduling one the next step's commit ended or
    its scheduling preempted); returns the rows it cleared."""
    gone = {i for i, (r, s) in enumerate(zip(batch.reqs, samples)) if s and r.status is not Status.RUNNING}
    for i in gone:
        samples[i] = False
    return gone


def _kept_rows(batch: Batch, launched: list[int], gone: set[int]) -> list[int]:
    """The forward's logits rows of the `launched` rows (one each, and one per draft token) but those of `gone`."""
    rows, start = [], 0
    for i in launched:
        n = 1 + len(batch.reqs[i].draft)
        if i not in gone:
            rows += range(start, start + n)
        start += n
    return rows


def _subset(batch: Batch, rows: list[int]) -> Batch:
    """The batch of `rows`' requests, with those of them it admitted (`Scheduler.unadmit` after a failure)."""
    part = Batch()
    for i in rows:
        part.add(batch.reqs[i], batch.num_new_tokens[i])
    kept = set(part.reqs)
    part.admitted = [r for r in batch.admitted if r in kept]
    return part


class _ForwardThread:
    """The thread a step's forward runs on under `async_output_proc`. A daemon: a forward stuck on a hung device
    must not hold the process at exit (the service's watchdog replaces the engine)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="sluice-forward", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], torch.Tensor]) -> Future:
        done: Future = Future()
        self._jobs.put((fn, done))
        return done

    def stop(self, wait: bool = True) -> None:
        """Ends the thread once its forward (if any) returns; with `wait`, waits for that a while. NOTE: a thread
        still ending while the interpreter shuts down aborts the process (torch's thread state): `close()` and a
        let-go engine wait; `rebuilt()` does not (a forward stuck on a hung device must not hold the new engine)."""
        self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                done.set_result(fn())
            except BaseException as e:  # the engine thread raises it from `result()`
                done.set_exception(e)
            del job, fn, done  # waiting for the next, it holds nothing of this one (the runner, its pool, logits)


@dataclass
class _Emit:
    """What `LLMEngine._emit` makes a step's output of: the request's new tokens (and logprobs), those whose text
    is still to be made (`text_ids`, then `flush`), how the step ended it, its generator after the step."""

    req: Request
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text_ids: list[int] = field(default_factory=list)
    flush: bool = False
    reason: str | None = None
    rng_state: tuple[int, int] | None = None  # a SeededStream's


@dataclass(eq=False)
class _InFlight:
    """A step launched under async scheduling whose tokens are not committed yet: its forward and its result (the
    sampling's, on the forward thread), the generators before it sampled, each sampled request's row in it (what
    the next step's forward reads), the requests it gave a placeholder, what it counted computed ahead of time and
    the block table each request had then (a new table: preempted since), the prompt tokens it computes and, with
    an ITL target or speculation, its step-cost features."""

    batch: Batch
    samples: list[bool]
    launched: list[int]  # the rows its forward computes logits for
    forward: Future | None = None
    result: Future | None = None  # None until its sampling is queued (`_sample`)
    rng: list = field(default_factory=list)
    rows: dict[Request, int] = field(default_factory=dict)
    placed: list[Request] = field(default_factory=list)
    advanced: list[tuple[Request, int]] = field(default_factory=list)
    tables: dict[Request, list[int]] = field(default_factory=dict)  # each request's block table when it launched
    prompt_tokens: int = 0
    cost_x: tuple[int, int, float, bool] | None = None

    def unplace(self) -> None:
        """Takes its placeholders out of its requests' tokens."""
        for r in self.placed:
            r.token_ids.pop()
            r.num_placeholders -= 1


def _restore(rng: list[tuple[torch.Generator | SeededStream, Any]]) -> None:
    """Puts the generators back where `LLMEngine._rng_state` found them."""
    for g, state in rng:
        g.set_state(state)
