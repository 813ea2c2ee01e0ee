"""Turns a scheduled batch into tensors, runs the model forward and samples.

Per-step metadata (token ids, positions, slots, block tables) is written into host buffers allocated once
(engine/step_inputs.py); building it loops over requests, never over tokens.

The KV pool is a list over layers of `(k_cache, v_cache)`, or `(k_cache, v_cache, k_scale, v_scale)` when it is
quantized; every part of a layer is indexed by block first, so a block moves as `part[block]` of each.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.cuda_graphs import StepGraphs
from engine.layout import Layout
from engine.models import LlamaModel
from engine.models.llama import AttentionMetadata
from engine.request import PromptLogprob, Request, TokenLogprob
from engine.sampler import Sampler
from engine.scheduler import Batch
from engine.step_inputs import StepInputs


def kv_parts(model: LlamaModel, layout: Layout) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (block shape, dtype) of each part of a layer's pool, for `model`'s KV heads (its shard's, under tensor
    parallelism): K and V, and their scales when the cache is quantized."""
    shape = (layout.block_size, model.num_kv_heads, model.cfg.head_dim)
    kv, scale = (shape, layout.cache_dtype), (shape[:2], torch.float32)
    return [kv, kv, scale, scale] if layout.quantized else [kv, kv]


def kv_pool(model: LlamaModel, layout: Layout, num_blocks: int | None = None,
            device: torch.device | None = None) -> list[tuple[torch.Tensor, ...]]:
    """A zeroed pool of `num_blocks` (default: the layout's) blocks of `kv_parts` per layer. NOTE: zeros, not
    empty: padded block-table entries point at block 0, and stale values must be finite so a masked-out score
    (weight 0) never turns into 0 * NaN."""
    n = layout.num_blocks if num_blocks is None else num_blocks
    return [tuple(torch.zeros((n, *s), dtype=d, device=device or layout.device) for s, d in kv_parts(model, layout))
            for _ in range(model.cfg.num_layers)]


class ModelRunner:
    def __init__(self, model: LlamaModel, *, layout: Layout, max_num_tokens: int, max_num_seqs: int, seed: int,
                 kv_caches: list[tuple[torch.Tensor, ...]] | None = None, workers=None,
                 draft_model: LlamaModel | None = None, graph_sizes: tuple[list[int], list[int]] | None = None):
        """`max_num_tokens`, `max_num_seqs`: the most tokens and sequences one step may hold. `kv_caches`: the pool
        of a runner this one replaces, kept with what it holds (else a new one). `workers`: the other ranks of a
        tensor-parallel group (engine/parallel.py), sent each step's inputs before its forward. `draft_model`:
        speculative decoding's draft model (engine/spec.py); its KV lives in blocks of the same ids, in
        `draft_caches` (the block tables index both). `graph_sizes`: the buckets steps are captured at in CUDA graphs,
        (decode batch sizes, mixed token counts) (engine/cuda_graphs.py; on a CPU the same buffers run eagerly: for
        tests)."""
        cfg, device = model.cfg, layout.device
        self.model = model
        self.workers = workers
        self.block_size = layout.block_size
        self.device = device
        self.parts = kv_parts(model, layout)
        self.block_bytes = cfg.num_layers * sum(math.prod(s) * d.itemsize for s, d in self.parts)  # every layer
        self.kv_caches = kv_caches or kv_pool(model, layout)
        self.draft_model = draft_model
        self.draft_caches = kv_pool(draft_model, layout) if draft_model is not None else []
        # a block holds the draft model's KV too (not copied to the host tier or the prefix store)
        self.draft_block_bytes = 0 if draft_model is None else draft_model.cfg.num_layers * sum(
            math.prod(s) * d.itemsize for s, d in kv_parts(draft_model, layout))
        self.max_blocks_per_seq = -(-layout.max_model_len // layout.block_size)
        # the host tier (engine/block_manager.py): slots in host memory, the same layout per layer. NOTE: not pinned:
        # the copies go through pageable temporaries anyway, and torch's pinned allocator rounds every tensor up
        # to a power of two (a 40 GiB tier could pin 64)
        self.host_caches = kv_pool(model, layout, layout.num_host_blocks, torch.device("cpu")) if layout.num_host_blocks else []
        self.copy_seconds = 0.0  # spent in copy_blocks
        self.draft_work = (0, 0, 0.0)  # the last step's draft model: forwards, tokens, seconds (its cost model's input)
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.sampler = Sampler(seed, device)
        self.sampled: torch.Tensor | None = None  # the last `sample`'s tokens, on the device (async scheduling)
        self.inputs: list[StepInputs] = []
        self.graphs = self.step_graphs(*graph_sizes, capture=device.type == "cuda") if graph_sizes else None
        if not self.inputs:
            self._size_inputs(max_num_tokens, max_num_seqs)

    def _size_inputs(self, max_tokens: int, max_seqs: int) -> None:
        """Two sets of step inputs, one step each in turn: with async scheduling a step is prepared while the last
        one runs (on a CPU its forward reads them in place)."""
        pin = self.device.type == "cuda"
        self.inputs = [StepInputs(max_tokens, max_seqs, self.max_blocks_per_seq, pin) for _ in range(2)]

    def step_graphs(self, decode_sizes: list[int], mixed_tokens: list[int], capture: bool) -> StepGraphs:
        """Graphs at these decode batch sizes and mixed token counts over this runner's model and pool (the step
        inputs grow to hold their padding); `capture=False` runs the buckets eagerly on the graphs' buffers (how the
        CPU tests and gpu_check's dry run check them)."""
        g = StepGraphs(self.model, self.kv_caches, decode_sizes, mixed_tokens, self.max_num_seqs,
                       self.max_blocks_per_seq, self.block_size, self.device, capture=capture)
        self._size_inputs(max(g.ints.shape[1], self.max_num_tokens), max(len(g.seq_lens), self.max_num_seqs))
        return g

    def _claim_inputs(self) -> StepInputs:
        """The next set of step inputs, free to rewrite."""
        self.inputs.reverse()
        return self.inputs[1].claim()

    def _tokens(self, batch: Batch) -> tuple[list[int], list[list[int]]]:
        """Each request's first position and the tokens it computes this step (with a draft: through its draft)."""
        starts = [r.num_computed_tokens for r in batch.reqs]
        return starts, [r.token_ids[s : s + n] if not r.draft else r.token_ids[s:] + r.draft
                        for r, s, n in zip(batch.reqs, starts, batch.num_new_tokens)]

    def _metadata(self, reqs: list[Request], starts: list[int], tokens: list[list[int]], rows: list[int],
                  extra: list[int], prompt_rows: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, AttentionMetadata]:
        """Metadata on the device for computing `tokens[i]` of `reqs[i]` at positions from `starts[i]`; the last
        token of each sequence in `rows` reaches the LM head, with the `extra[j]` tokens before it (a draft's), and
        after them, for each (i, k) of `prompt_rows`, the first k tokens of sequence i (prompt logprobs)."""
        buf = self._claim_inputs()
        cu = buf.fill(reqs, starts, tokens, self.block_size)
        B, T, dev = len(reqs), int(cu[-1]), self.device
        meta = AttentionMetadata(
            positions=buf.positions[:T].to(dev, non_blocking=True),
            slot_mapping=buf.slot_mapping[:T].to(dev, non_blocking=True),
            block_tables=buf.block_tables.to(dev, non_blocking=True),
            cu_seqlens_q=buf.cu_seqlens_q[: B + 1].to(dev, non_blocking=True),
            seq_lens=buf.seq_lens[:B].to(dev, non_blocking=True),
            logits_indices=torch.from_numpy(np.concatenate([_logits_indices(cu[1:][rows] - 1, extra), *(
                np.arange(cu[i], cu[i] + k) for i, k in prompt_rows)])).to(dev),
        )
        input_ids = buf.input_ids[:T].to(dev, non_blocking=True)
        buf.copied()
        return input_ids, meta

    def _draft(self, batch: Batch) -> None:
        """Fills the drafts the scheduler reserved room for (`speculative="draft:DIR"`) with the draft model's greedy
        tokens. Its KV is computed lazily: a drafting request's first catches up from where it stopped
        (`num_draft_computed`; a request's first draft runs its whole prompt through the draft model) to its last
        token, which yields the draft's first token, in as many forwards as the step buffers need; then one forward
        per further draft token, for the requests that still want one. A step where nobody drafts costs nothing.
        `num_draft_computed` moves only after the step (the engine), so a retried step drafts the same again."""
        t, forwards, tokens = time.perf_counter(), 0, 0
        want = [r for r in batch.reqs if r.draft]
        group: list[Request] = []
        size, cap = 0, self.max_num_tokens
        for r in want + [None]:  # groups of catch-ups that fit the buffers (one always does: < max_model_len)
            n = 0 if r is None else r.num_tokens - r.num_draft_computed
            if group and (r is None or size + n > cap):
                first = self._draft_step(group, [g.num_draft_computed for g in group],
                                         [g.token_ids[g.num_draft_computed :] for g in group], list(range(len(group))))
                for g, tok in zip(group, first):
                    g.draft[0] = tok
                forwards, tokens = forwards + 1, tokens + size
                group, size = [], 0
            if r is not None:
                group.append(r)
                size += n
        for j in range(1, max((len(r.draft) for r in want), default=0)):
            more = [r for r in want if len(r.draft) > j]
            nxt = self._draft_step(more, [r.num_tokens - 1 + j for r in more], [[r.draft[j - 1]] for r in more],
                                   list(range(len(more))))
            for r, tok in zip(more, nxt):
                r.draft[j] = tok
            forwards, tokens = forwards + 1, tokens + len(more)
        self.draft_work = (forwards, tokens, time.perf_counter() - t)  # (`_draft_step` waits for the device)

    def _draft_step(self, reqs: list[Request], starts: list[int], tokens: list[list[int]], rows: list[int]) -> list[int]:
        input_ids, meta = self._metadata(reqs, starts, tokens, rows, [0] * len(rows))
        return self.draft_model.forward(input_ids, meta, self.draft_caches).argmax(-1).tolist()

    def copy_blocks(self, offloads: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Before a forward: device blocks to host slots (`offloads`), then host slots to device blocks (`loads`).

        NOTE: on CUDA they are synchronous (the host waits for them); pinned staging buffers and a side stream that
        would overlap them with the step are not built yet."""
        t = time.perf_counter()
        dev = self.device
        if offloads:
            src = torch.tensor([b for b, _ in offloads], device=dev)
            dst = torch.tensor([s for _, s in offloads])
            for layer, host in zip(self.kv_caches, self.host_caches):
                for d, h in zip(layer, host):
                    _raw(h).index_copy_(0, dst, _raw(d).index_select(0, src).cpu())
        if loads:
            src = torch.tensor([s for s, _ in loads])
            dst = torch.tensor([b for _, b in loads], device=dev)
            for layer, host in zip(self.kv_caches, self.host_caches):
                for d, h in zip(layer, host):
                    _raw(d).index_copy_(0, dst, _raw(h).index_select(0, src).to(dev, non_blocking=True))
        self.copy_seconds += time.perf_counter() - t

    def block_shapes(self, n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """What `read_blocks` returns for n blocks: (shape, dtype) of each part."""
        return [((len(self.kv_caches), n, *s), d) for s, d in self.parts]

    def read_blocks(self, ids: list[int]) -> list[torch.Tensor]:
        """Each part of these blocks (K, V and, quantized, their scales), every layer, on the host:
        `[layers, len(ids), block_size, kv_heads(, head_dim)]` each."""
        idx = torch.tensor(ids, device=self.device)  # one layer at a time to the host: no device-sized stack
        return [torch.stack([_raw(layer[p]).index_select(0, idx).cpu() for layer in self.kv_caches]).view(d)
                for p, (_, d) in enumerate(self.parts)]

    def write_blocks(self, ids: list[int], parts: list[torch.Tensor]) -> None:
        """The inverse of `read_blocks`."""
        idx = torch.tensor(ids, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            for dst, src in zip(cache, parts):
                _raw(dst).index_copy_(0, idx, _raw(src[layer].to(dst.dtype)).to(self.device))

    def device_ok(self) -> bool:
        """Does a trivial computation still work on the device? (After a CUDA error none does; with a rank of the
        tensor-parallel group gone, no forward does.)"""
        if self.workers is not None and not self.workers.alive():
            return False
        try:
            return torch.ones(1, device=self.device).add_(1).item() == 2.0
        except Exception:
            return False

    def run(self, batch: Batch, samples: list[bool]) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """Computes the batch's new tokens; returns, for each request with `samples[i]`, its new tokens (one, or
        with a draft the draft tokens verification kept and one more) and their logprobs if it asked for them."""
        return self.sample(batch, samples, self.launch(batch, samples)())

    def launch(self, batch: Batch, samples: list[bool], placeholders: dict[int, int] | None = None
               ) -> Callable[[], torch.Tensor]:
        """Does now all of the step that reads its requests (drafts, metadata into the step's buffers); returns its
        forward, which reads none of them: it may run on another thread while they change (the engine's
        `async_output_proc` and `async_scheduling`). The forward returns the sampled rows' logits.

        `placeholders` (async scheduling): {row: j} for the rows whose last input token is the j-th token the last
        step samples (`Request.num_placeholders`): the forward reads them from `sampled`, on the device, so it must
        run after that step's sampling."""
        rows = [i for i, s in enumerate(samples) if s]
        # with nothing to sample, one row still goes through the LM head: the forward fills the KV cache
        self.draft_work = (0, 0, 0.0)
        if self.draft_model is not None and any(r.draft for r in batch.reqs):
            self._draft(batch)
        tokens: Callable[[], torch.Tensor] | None = None
        if placeholders:
            src = torch.tensor(list(placeholders.values()), device=self.device)

            def read() -> torch.Tensor:  # on the forward thread, after the last step's sampling
                if self.sampled is None:
                    raise RuntimeError("the step before this one sampled nothing: the tokens it reads are not known")
                return self.sampled[src]
            tokens = read
        if tokens is not None:  # each such row's last input token
            dst = torch.from_numpy(np.cumsum(batch.num_new_tokens)[list(placeholders)] - 1).to(self.device)
        starts, new = self._tokens(batch)
        extra = [len(batch.reqs[i].draft) for i in rows]  # each sampled row's draft: its positions are verified too
        prompt = _prompt_rows(batch, starts)
        if self.graphed(batch, samples) and not prompt:
            buf = self._claim_inputs()
            cu = buf.fill(batch.reqs, starts, new, self.block_size)
            indices = _logits_indices(cu[1:][rows] - 1, extra)
            return self.graphs.stage(buf, cu, indices, None if tokens is None else (dst, tokens))
        if not rows:  # (so no draft either: a drafting request samples)
            rows, extra = [0], [0]
        input_ids, meta = self._metadata(batch.reqs, starts, new, rows, extra, [(i, k) for i, k, _ in prompt])
        if self.workers is not None:
            self.workers.step(input_ids, meta)
        sampled_rows = len(rows) + sum(extra)
        # each prompt row's request, the position its logits predict and that position's token
        targets = [(batch.reqs[i], p + 1, batch.reqs[i].token_ids[p + 1])
                   for i, k, first in prompt for p in range(first, first + k)]

        def forward() -> torch.Tensor:
            if tokens is not None:
                input_ids[dst] = tokens()
            logits = self.model.forward(input_ids, meta, self.kv_caches)
            if targets:
                _prompt_logprobs(logits[sampled_rows:], targets)
                logits = logits[:sampled_rows]
            return logits

        return forward

    def sample(self, batch: Batch, samples: list[bool], logits: torch.Tensor
               ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """`run`'s result from the forward's logits."""
        reqs = [r for r, s in zip(batch.reqs, samples) if s]
        self.sampled = None
        if not reqs:
            return [], []
        if any(r.draft for r in reqs):
            return self.sampler.verify(logits, reqs)
        tokens, logprobs = self.sampler(logits, reqs)
        self.sampled = self.sampler.last
        return [[t] for t in tokens], [None if lp is None else [lp] for lp in logprobs]

    def graphed(self, batch: Batch, samples: list[bool]) -> bool:
        """Is this a step a graph replays (`samples`: `batch.samples()`): a bucket holds its tokens and sequences, and
        has room for its logits rows (one per sampled sequence and per draft token it verifies: those may not fit)?"""
        key = None if self.graphs is None else self.graphs.bucket(sum(batch.num_new_tokens), len(batch))
        return key is not None and sum(1 + len(r.draft) for r, s in zip(batch.reqs, samples) if s) <= key[1]


def _prompt_rows(batch: Batch, starts: list[int]) -> list[tuple[int, int, int]]:
    """(row, k, first position) for each request of `batch` whose prompt's logprobs are wanted, k the positions of its
    chunk whose next token is a prompt token (the prompt's last position predicts the first new token: sampled)."""
    return [(i, k, s) for i, (r, s, n) in enumerate(zip(batch.reqs, starts, batch.num_new_tokens))
            if r.wants_prompt_logprobs and (k := min(s + n, r.num_prompt_tokens - 1) - s) > 0]


PROMPT_LOGPROBS_SLICE = 32  # rows made into logprobs at once: in cache (32 rows of a 8,192 vocabulary: 1 MB), and
# the work's memory is theirs, not the step's (a slice of 2,048 rows took 1.7x as long)


def _prompt_logprobs(logits: torch.Tensor, targets: list[tuple[Request, int, int]]) -> None:
    """Each prompt row's logprobs (raw, as the model gives them) into its request's `prompt_lps`, by position."""
    k = max(r.params.prompt_logprobs for r, _, _ in targets)
    for a in range(0, len(targets), PROMPT_LOGPROBS_SLICE):
        part = targets[a : a + PROMPT_LOGPROBS_SLICE]
        lp = logits[a : a + len(part)].float().log_softmax(-1)
        chosen = lp.gather(1, torch.tensor([t for _, _, t in part], device=lp.device)[:, None])
        ranks = ((lp > chosen).sum(-1) + 1).tolist()
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i, chosen_ = top_v.tolist(), top_i.tolist(), chosen[:, 0].tolist()
        for j, (r, pos, token) in enumerate(part):
            n = r.params.prompt_logprobs
            r.prompt_lps[pos] = PromptLogprob(token, chosen_[j], ranks[j], list(zip(top_i[j][:n], top_v[j][:n])))


def _logits_indices(last: np.ndarray, drafts: list[int]) -> np.ndarray:
    """Each row's last token, preceded by its `drafts[i]` tokens before it: a draft's positions are verified too."""
    if not any(drafts):
        return last
    return np.concatenate([np.arange(e - d, e + 1) for e, d in zip(last.tolist(), drafts)])


def _raw(t: torch.Tensor) -> torch.Tensor:
    """`t`, or its bytes where torch has no copy kernels for its dtype (fp8 on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
