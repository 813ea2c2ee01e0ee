"""A step's inputs on the host, written by one function for the eager forward and for the CUDA graphs alike.

Token ids, positions and KV slots per token; block tables, query offsets (`cu_seqlens_q`) and context lengths per
sequence; the rows that reach the LM head. Building them loops over requests, never over tokens. The buffers are
allocated once, pinned on CUDA so the copies out are asynchronous, and come in sets the runner uses in turn
(engine/model_runner.py): a set is rewritten only after the copies out of it are done (`claim`).
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from engine.request import Request


def block_row(req: Request) -> np.ndarray:
    """`req.block_table` as an int32 array, kept with the request and brought up to date here: only the entries
    appended since the last step are converted (a long context's table is not rebuilt from a Python list every
    step). The block manager only appends, pops (`trim`, which lowers `block_table_seen`) or starts a new list."""
    table, n = req.block_table, len(req.block_table)
    if req.block_row_of is not table:
        req.block_row_of, req.block_table_seen = table, 0
    row = req.block_row
    if row is None or len(row) < n:
        grown = np.zeros(max(n, 16, 2 * (0 if row is None else len(row))), dtype=np.int32)
        if row is not None:
            grown[: req.block_table_seen] = row[: req.block_table_seen]
        req.block_row = row = grown
    if req.block_table_seen < n:
        row[req.block_table_seen : n] = table[req.block_table_seen :]
    req.block_table_seen = n
    return row[:n]


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, pin: bool):
        self.ints = torch.zeros((3, max_tokens), dtype=torch.int64, pin_memory=pin)  # token ids, positions, slots
        self.input_ids, self.positions, self.slot_mapping = self.ints
        # a step's block tables, [B, w] for its B sequences and the most blocks one has, contiguous: one copy out,
        # however narrow the step's tables are beside `max_blocks_per_seq`
        self.tables = torch.zeros(max_seqs * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.block_tables = self.tables[:0].view(0, 1)
        self.cu_seqlens_q = torch.zeros(max_seqs + 1, dtype=torch.int32, pin_memory=pin)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, pin_memory=pin)
        self.logits_indices = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin)
        self.copies_done = torch.cuda.Event() if pin else None

    def claim(self) -> StepInputs:
        """This set, once the copies out of it (asynchronous on CUDA) are done: it may be rewritten."""
        if self.copies_done is not None:
            self.copies_done.synchronize()
        return self

    def copied(self) -> None:
        """Marks the copies out of this set launched so far: `claim` waits for them."""
        if self.copies_done is not None:
            self.copies_done.record()

    def fill(self, reqs: list[Request], starts: list[int], tokens: list[list[int]], block_size: int) -> np.ndarray:
        """Writes the inputs for computing `tokens[i]` of `reqs[i]` at positions from `starts[i]`; returns
        `cu_seqlens_q` (B + 1 token offsets; the step has `cu[-1]` tokens). `block_tables` becomes the step's,
        [B, most blocks of one request], zero past a request's own."""
        B, bs = len(reqs), block_size
        ns = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=B)
        starts = np.asarray(starts, dtype=np.int64)
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(ns, out=cu[1:])
        T = int(cu[-1])
        ids, pos, slots = self.ints.numpy()[:, :T]
        ids[:] = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=T)
        pos[:] = np.arange(T) + np.repeat(starts - cu[:-1], ns)
        rows = [block_row(r) for r in reqs]
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=B)
        w = max(int(lens.max(initial=1)), 1)
        self.block_tables = self.tables[: B * w].view(B, w)
        bt = self.block_tables.numpy()
        bt.fill(0)
        if B:
            bt[np.arange(w) < lens[:, None]] = np.concatenate(rows)  # row-major: each row's blocks, then zeros
        seq_of_token = np.repeat(np.arange(B), ns)
        slots[:] = bt[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        self.cu_seqlens_q.numpy()[: B + 1] = cu
        self.seq_lens.numpy()[:B] = starts + ns
        return cu
