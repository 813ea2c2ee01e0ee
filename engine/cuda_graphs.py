"""CUDA graphs for decode and mixed steps (docs/architecture.md §8): the forward captured once per bucket of
(tokens, sequences).

An eager step runs ~240 kernels launched one by one from Python, and on a GPU that costs the host more time than the
GPU takes to run them (issue 15's H200 profile of the eager step: the GPU busy 1.5 ms of a 12.8 ms step). So at
start-up the runner runs the forward once per bucket on static device buffers and records it; a step then writes its
inputs into those buffers, padded up to the smallest bucket that holds it, and replays that bucket's graph.

Two kinds of bucket:
- decode: B sequences of one token each, B in `capture_sizes` (1, 2, 4, 8, then multiples of 16); the attention
  runs its decode tiling, with the KV split when the batch leaves SMs idle;
- mixed (`cudagraph_mode="full"`): up to T tokens, in `token_sizes` (multiples of 16, then steps of at most an
  eighth), over `max_num_seqs` sequences and a few for padding: decodes and prompt chunks together. The whole
  forward, attention included, is recorded: the one Triton launch covers any mix of query lengths, so nothing stays
  outside the graph (vLLM records such steps piecewise, around attention, because its attention backends plan on
  the host per step; this kernel does not).

What makes one recording right for every step of its bucket:
- the forward reads only the static buffers and the KV pool, and never the host (the Triton launchers read shapes,
  not values: sluice_kernels/triton/attention.py);
- block tables are full width (`max_model_len` of blocks), so the attention grid and its split-KV count are fixed
  per bucket and cover any context;
- a padding token is token 0 at position 0 with slot -1 (`store_kv` skips it); the padding tokens are spread
  evenly over the padding sequences (a decode bucket's: one each), each seeing its own tokens, all in block 0
  (finite: the pool starts zeroed); a mixed bucket has enough padding sequences that none sees past
  `max_model_len`, and those left without a token are empty (the kernel's programs for them return at once).
  Every sequence's row reaches the LM head: a step's sampled rows first, then token 0's, whose logits are
  dropped. The warm-up and capture runs are all padding: they write no KV (a kept pool's cached blocks survive);
- each graph copies its logits into one shared output buffer, so the pool holds one bucket's activations, not
  every bucket's logits.

Bounds: decode buckets stop at 512 sequences (`MAX_CAPTURE_SIZE`, as vLLM's), mixed ones at `MAX_CAPTURE_TOKENS`;
larger steps run eagerly, where the launches weigh less against the work. Every graph shares one memory pool, the
largest recorded first; capture time and memory are logged. The attention's split-KV count is chosen for
`max_model_len`, not the context of the moment (a long `max_model_len` and short contexts split more than an eager
step would).

A step verifying drafts replays too, its verified positions among the LM-head rows (while they fit: one per the
bucket's sequences); a draft model's own forwards run eagerly. Off unless asked for
(`EngineConfig.enforce_eager=False`): no GPU has run this code yet (issue 15). With `capture=False` the buckets run eagerly on the same buffers: how the CPU tests check the
padding and the buffers against the plain path.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.config import EngineConfig
from engine.models import LlamaModel
from engine.models.llama import AttentionMetadata
from engine.step_inputs import StepInputs

log = logging.getLogger("sluice.engine")


MAX_CAPTURE_SIZE = 512
MAX_CAPTURE_TOKENS = 8192


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The decode buckets: 1, 2, 4, 8, then every multiple of 16, up to the first that holds `max_num_seqs`
    (at most `MAX_CAPTURE_SIZE`)."""
    n = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, 8, *range(16, n + 16, 16)]
    return sizes[: bisect.bisect_left(sizes, n) + 1]


def token_sizes(max_num_tokens: int) -> list[int]:
    """The mixed buckets' token counts: multiples of 16 up to 256, then steps of an eighth of the power of two
    below (32 up to 512, 64 up to 1024, ...: a step pads at most 1/8 of its tokens), up to the first that holds
    `max_num_tokens` (at most `MAX_CAPTURE_TOKENS`)."""
    n, sizes = min(max_num_tokens, MAX_CAPTURE_TOKENS), [16]
    while sizes[-1] < n:
        t = sizes[-1]
        sizes.append(t + max(16, 1 << (t.bit_length() - 4)))
    return sizes


def graph_sizes(config: EngineConfig) -> tuple[list[int], list[int]]:
    """What an engine of `config` captures: its decode batch sizes, and its mixed token counts (none under
    `cudagraph_mode="full_decode_only"`)."""
    mixed = token_sizes(config.max_num_batched_tokens) if config.cudagraph_mode == "full" else []
    return capture_sizes(config.max_num_seqs), mixed


Bucket = tuple[int, int]  # (tokens, sequences), padding included


def buckets(decode_sizes: list[int], mixed_tokens: list[int], max_num_seqs: int, max_len: int
            ) -> tuple[list[Bucket], list[Bucket]]:
    """The decode buckets, B sequences of one token each, and the mixed ones, smallest first. A mixed bucket has
    room for `max_num_seqs` sequences and enough padding sequences that its padding, spread over them, gives none a
    context past `max_len` tokens (what a block table row holds), and never as many sequences as tokens (the
    attention would take it for a decode step and tile it so)."""
    pads = -(-max(mixed_tokens, default=0) // max_len)
    pads += max_num_seqs + pads in mixed_tokens
    return [(b, b) for b in sorted(decode_sizes)], [(t, max_num_seqs + pads) for t in sorted(mixed_tokens)]


class StepGraphs:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, ...]], decode_sizes: list[int],
                 mixed_tokens: list[int], max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, *, capture: bool = True):
        """`decode_sizes`: the decode buckets' batch sizes; `mixed_tokens`: the mixed buckets' token counts (empty:
        decode steps only); `max_num_seqs`: the most sequences a step holds."""
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.decode, self.mixed = buckets(decode_sizes, mixed_tokens, max_num_seqs, max_blocks_per_seq * block_size)
        n, s = map(max, zip(*self.decode, *self.mixed))
        # the static inputs; all padding until a step fills them: the warm-up and capture runs store nothing
        self.ints = torch.zeros((3, n), dtype=torch.int64, device=device)  # token ids, positions, slots
        self.ints[2].fill_(-1)
        self.block_tables = torch.zeros((s, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.tables = torch.zeros(s * max_blocks_per_seq, dtype=torch.int32, device=device)  # a step's, [B, w] (H2D)
        self.cu_seqlens_q = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.rows = torch.zeros(s, dtype=torch.int64, device=device)
        self.logits = torch.zeros((s, model.cfg.vocab_size), dtype=torch.float32, device=device)  # every graph's output
        self.replays: dict[Bucket, Callable[[], torch.Tensor]] = {}
        if capture:
            self._capture(device)
        else:
            self.replays = {k: (lambda k=k: self._forward(k)) for k in set(self.decode + self.mixed)}

    def _forward(self, key: Bucket) -> torch.Tensor:
        t, s = key
        meta = AttentionMetadata(positions=self.ints[1, :t], slot_mapping=self.ints[2, :t],
                                 block_tables=self.block_tables[:s], cu_seqlens_q=self.cu_seqlens_q[: s + 1],
                                 seq_lens=self.seq_lens[:s], logits_indices=self.rows[:s])
        out = self.logits[:s]
        out.copy_(self.model.forward(self.ints[0, :t], meta, self.kv_caches))
        return out

    def _pad_all(self, key: Bucket) -> None:
        """The static inputs as a batch of padding only (`pad`), for `key`'s warm-up and capture."""
        t, s = key
        host = StepInputs(t, s, 1, pin=False)
        pad(host, np.zeros(1, dtype=np.int64), key, self.block_size)
        self.ints[:, :t] = host.ints
        self.block_tables[:s] = 0
        self.cu_seqlens_q[: s + 1] = host.cu_seqlens_q
        self.seq_lens[:s] = host.seq_lens
        self.rows[:s] = host.logits_indices

    def _capture(self, device: torch.device) -> None:
        """Largest bucket first, all in one memory pool: a smaller graph reuses what the larger one allocated."""
        t, (free_before, _) = time.perf_counter(), torch.cuda.mem_get_info(device)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        for key in sorted(set(self.decode + self.mixed), reverse=True):  # (a mixed bucket may equal a decode one)
            self._pad_all(key)
            # a warm-up run first, off the capture: Triton compiles, cuBLAS picks its kernels and workspace
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(key)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (a stuck engine's, during a rebuild) do not void the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(key)
            self.replays[key] = lambda graph=graph, logits=logits: (graph.replay(), logits)[1]
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("captured %d CUDA graphs (decode: batch %s; mixed: tokens %s) in %.1f s, %.0f MiB",
                 len(self.replays), _span(self.decode), _span(self.mixed), time.perf_counter() - t, used / 2**20)

    def bucket(self, num_tokens: int, num_seqs: int) -> Bucket | None:
        """The smallest bucket that holds a step of `num_tokens` over `num_seqs` sequences: a decode bucket when
        every sequence has one token, else a mixed one; None where none does (the step runs eagerly)."""
        if num_tokens == num_seqs and self.decode and num_seqs <= self.decode[-1][1]:
            return self.decode[bisect.bisect_left(self.decode, (num_seqs, 0))]
        if self.mixed and num_tokens <= self.mixed[-1][0] and num_seqs <= self.max_num_seqs:
            return self.mixed[bisect.bisect_left(self.mixed, (num_tokens, 0))]
        return None

    def eager_from(self, decodes: int, drafts: int = 0) -> int:
        """The fewest prompt tokens that make a step of `decodes` decodes, with `drafts` draft tokens among them, run
        eagerly (as `ModelRunner.graphed` decides): 0 where it does with none (no bucket holds it, or its logits
        rows, one per decode and draft token, do not fit one); without mixed buckets (`full_decode_only`) 1, or 2
        where one prompt token still makes a decode-shaped step; else past the largest mixed bucket."""
        if decodes:
            key = self.bucket(decodes + drafts, decodes)
            if key is None or decodes + drafts > key[1]:
                return 0
        if not self.mixed:
            return 2 if self.bucket(decodes + 1, decodes + 1) is not None else 1
        return max(1, self.mixed[-1][0] - decodes - drafts + 1)

    def stage(self, inputs: StepInputs, cu: np.ndarray, rows: np.ndarray,
              fill: tuple[torch.Tensor, Callable[[], torch.Tensor]] | None = None) -> Callable[[], torch.Tensor]:
        """The replay of a step whose inputs `inputs` holds (`StepInputs.fill`, which returned `cu`), padded here to
        its bucket (`bucket` must have one); `rows`: the tokens whose logits it returns (at most one per the bucket's
        sequences: a sequence's last, and with a draft the positions it verifies). The replay
        reads neither the requests nor, once it has run, `inputs`: it copies them into the graphs' buffers first
        (on the thread that runs it, so after any replay launched before it), then, with `fill` = (token indices,
        tokens), sets those tokens' ids to `tokens()`, device values (async scheduling: the tokens the last step
        sampled). It returns the logits `[len(rows), vocab]`: the graphs' shared output buffer, overwritten by the
        next replay."""
        B, T, R = len(cu) - 1, int(cu[-1]), len(rows)
        key = self.bucket(T, B)
        assert key is not None and B > 0 and R <= key[1], (T, B, R)
        t, s = key
        blocks = pad(inputs, cu, key, self.block_size)
        inputs.logits_indices.numpy()[:R] = rows
        w = inputs.block_tables.shape[1]
        replay = self.replays[key]

        def run() -> torch.Tensor:
            for k in range(3):
                self.ints[k, :t].copy_(inputs.ints[k, :t], non_blocking=True)
            # the step's tables, then into the full-width ones on the device: columns past a row's blocks are
            # never read (past its context), and the padding sequences' first ones are block 0
            self.tables[: B * w].copy_(inputs.tables[: B * w], non_blocking=True)
            self.block_tables[:B, :w] = self.tables[: B * w].view(B, w)
            if blocks:
                self.block_tables[B:s, :blocks] = 0
            self.cu_seqlens_q[: s + 1].copy_(inputs.cu_seqlens_q[: s + 1], non_blocking=True)
            self.seq_lens[:s].copy_(inputs.seq_lens[:s], non_blocking=True)
            self.rows[:s].copy_(inputs.logits_indices[:s], non_blocking=True)
            inputs.copied()
            if fill is not None:
                self.ints[0, fill[0]] = fill[1]()
            return replay()[:R]

        return run


def pad(inputs: StepInputs, cu: np.ndarray, key: Bucket, block_size: int) -> int:
    """Pads the step `inputs` holds (`cu`: its query offsets) to the bucket `key` = (t, s): tokens past the step's
    are token 0 at position 0, stored nowhere (slot -1), spread evenly over the sequences past the step's, each
    seeing its own tokens. Every sequence's LM-head row is token 0 (the step's rows are then written over it).
    Returns how many blocks a padding sequence reads: the first entries of their block table rows, all to be block 0
    (finite: the pool starts zeroed)."""
    t, s = key
    B, T = len(cu) - 1, int(cu[-1])
    inputs.ints.numpy()[:, T:t] = ((0,), (0,), (-1,))
    inputs.logits_indices.numpy()[:s] = 0
    if s == B:
        return 0
    lens = np.full(s - B, (t - T) // (s - B), dtype=np.int64)
    lens[: (t - T) % (s - B)] += 1
    np.cumsum(lens, out=inputs.cu_seqlens_q.numpy()[B + 1 : s + 1], dtype=np.int32)
    inputs.cu_seqlens_q.numpy()[B + 1 : s + 1] += T
    inputs.seq_lens.numpy()[B:s] = lens
    return -(-int(lens[0]) // block_size)


def _span(buckets: list[Bucket]) -> str:
    return "none" if not buckets else f"{buckets[0][0]}..{buckets[-1][0]}"
