"""CUDA graphs for decode steps (docs/architecture.md §8): the forward captured once per batch-size bucket.

A decode step runs the same ~240 kernels at a given batch size every time; launched one by one from Python they
cost the host more time than the GPU takes to run them (issue 15's H200 profile of the eager step: the GPU busy
1.5 ms of a 12.8 ms step). So at start-up the runner runs the forward once per
bucket (`capture_sizes`) on static device buffers and records it; a decode step of B requests then writes its
metadata into those buffers, padded up to the smallest bucket that holds B, and replays that bucket's graph.

What makes one recording right for every step of its bucket:
- the forward reads only the static buffers and the KV pool, and never the host (the Triton launchers read shapes,
  not values: kernels/triton/attention.py);
- block tables are full width (`max_model_len` of blocks), so the attention grid and its split-KV count are fixed
  per bucket and cover any context;
- a padding row is token 0 at position 0 with slot -1 (`store_kv` skips it), block 0 first in its block table and
  a context of one token: it reads block 0, whose values are finite (the pool starts zeroed), and its logits are
  dropped. The warm-up and capture runs are all padding: they write no KV (a kept pool's cached blocks survive);
- each graph copies its logits into one shared output buffer, so the pool holds one bucket's activations, not
  every bucket's logits.

Buckets stop at 512 sequences (`MAX_CAPTURE_SIZE`, as vLLM's): larger decode batches run eagerly, where the
launches weigh less against the work. The attention's split-KV count is chosen for `max_model_len`, not the
context of the moment (a long `max_model_len` and short contexts split more than an eager step would).

Steps with prompt chunks or drafts run eagerly. Off unless asked for (`EngineConfig.enforce_eager=False`): no GPU
has run this code yet (issue 15). With `capture=False` the buckets run eagerly on the same buffers: how the CPU
tests check the padding and the buffers against the plain path.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.models import LlamaModel
from engine.models.llama import AttentionMetadata
from engine.request import Request

log = logging.getLogger("sluice.engine")


MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size buckets: 1, 2, 4, 8, then every multiple of 16, up to the first that holds `max_num_seqs`
    (at most `MAX_CAPTURE_SIZE`)."""
    n = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, 8, *range(16, n + 16, 16)]
    return sizes[: bisect.bisect_left(sizes, n) + 1]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, ...]], sizes: list[int],
                 max_blocks_per_seq: int, block_size: int, device: torch.device, *, capture: bool = True):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.block_size = block_size
        n, pin = self.sizes[-1], device.type == "cuda"
        # the static inputs, and their host staging (pinned on CUDA, so the copies are asynchronous)
        self.ints = torch.zeros((3, n), dtype=torch.int64, device=device)  # token ids, positions, slots
        self.ints[2].fill_(-1)  # all padding until a step fills it: the warm-up and capture runs store nothing
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each, always
        self.rows = torch.arange(n, dtype=torch.int64, device=device)  # every row reaches the LM head
        self.logits = torch.zeros((n, model.cfg.vocab_size), dtype=torch.float32, device=device)  # every graph's output
        # two sets of staging, one step each in turn: with async scheduling a step is staged while the last one's
        # replay, which copies out of its own set, may not have started
        self.staging = [_Staging(n, max_blocks_per_seq, pin), _Staging(n, max_blocks_per_seq, pin)]
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        if capture:
            self._capture(device)
        else:
            self.replays = {b: (lambda b=b: self._forward(b)) for b in self.sizes}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(positions=self.ints[1, :b], slot_mapping=self.ints[2, :b],
                                 block_tables=self.block_tables[:b], cu_seqlens_q=self.cu_seqlens_q[: b + 1],
                                 seq_lens=self.seq_lens[:b], logits_indices=self.rows[:b])
        out = self.logits[:b]
        out.copy_(self.model.forward(self.ints[0, :b], meta, self.kv_caches))
        return out

    def _capture(self, device: torch.device) -> None:
        """Largest bucket first, all in one memory pool: a smaller graph reuses what the larger one allocated."""
        t, (free_before, _) = time.perf_counter(), torch.cuda.mem_get_info(device)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        for b in reversed(self.sizes):
            # a warm-up run first, off the capture: Triton compiles, cuBLAS picks its kernels and workspace
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(b)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (a stuck engine's, during a rebuild) do not void the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(b)
            self.replays[b] = lambda graph=graph, logits=logits: (graph.replay(), logits)[1]
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("captured %d CUDA graphs of the decode step (batch %d..%d) in %.1f s, %.0f MiB", len(self.sizes),
                 self.sizes[0], self.sizes[-1], time.perf_counter() - t, used / 2**20)

    def bucket(self, batch_size: int) -> int | None:
        """The smallest bucket that holds `batch_size` requests; None past the largest."""
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, reqs: list[Request]) -> torch.Tensor:
        """The logits `[len(reqs), vocab]` of a step that computes one token of each request (its token at
        `num_computed_tokens`, whose KV slot is allocated): the bucket's graph replayed. The tensor is the graphs'
        shared output buffer, overwritten by the next replay."""
        return self.stage(reqs)()

    def stage(self, reqs: list[Request], fill: tuple[torch.Tensor, Callable[[], torch.Tensor]] | None = None
              ) -> Callable[[], torch.Tensor]:
        """`run` in two: fills a staging set from the requests now; the replay it returns reads none of them. It
        copies the staging into the graphs' buffers first (on the thread that runs it, so after any replay launched
        before it), then, with `fill` = (rows, tokens), sets those rows' token ids to `tokens()`, device values (async
        scheduling: the tokens the last step sampled)."""
        B, bs = len(reqs), self.block_size
        b = self.bucket(B)
        assert b is not None and B > 0, (B, self.sizes)
        st = self.staging[0]
        self.staging.reverse()
        if st.copies_done is not None:
            st.copies_done.synchronize()
        pos = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=B)
        ints = st.ints.numpy()
        ints[0, :B] = [r.token_ids[r.num_computed_tokens] for r in reqs]
        ints[1, :B] = pos
        bt = st.block_tables.numpy()
        for i, r in enumerate(reqs):  # NOTE: entries past a row's blocks are stale ids: never read (past its context)
            bt[i, : len(r.block_table)] = r.block_table
        bt[B:b, 0] = 0
        ints[2, :B] = bt[np.arange(B), pos // bs].astype(np.int64) * bs + pos % bs
        ints[:, B:b] = ((0,), (0,), (-1,))  # padding: token 0 at position 0, stored nowhere
        lens = st.seq_lens.numpy()
        lens[:B] = pos + 1
        lens[B:b] = 1
        replay = self.replays[b]

        def run() -> torch.Tensor:
            self.ints.copy_(st.ints, non_blocking=True)  # whole: 3 rows of a few KB, one contiguous copy
            self.block_tables[:b].copy_(st.block_tables[:b], non_blocking=True)
            self.seq_lens[:b].copy_(st.seq_lens[:b], non_blocking=True)
            if st.copies_done is not None:
                st.copies_done.record()
            if fill is not None:
                self.ints[0, fill[0]] = fill[1]()
            return replay()[:B]

        return run


class _Staging:
    """Host staging of the graphs' inputs (pinned on CUDA, so the copies are asynchronous), and the event after the
    last copies out of it: it is rewritten only once they are done."""

    def __init__(self, n: int, max_blocks_per_seq: int, pin: bool):
        self.ints = torch.zeros((3, n), dtype=torch.int64, pin_memory=pin)  # token ids, positions, slots
        self.ints[2] = -1
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin)
        self.seq_lens = torch.ones(n, dtype=torch.int32, pin_memory=pin)
        self.copies_done = torch.cuda.Event() if pin else None
