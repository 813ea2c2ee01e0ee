"""StepInputs (engine/step_inputs.py): a request's block table copy, brought up to date each step with only what
was appended, stays equal to `block_table` through the block manager's appends, trims (pops that appends may follow
before the next step) and frees."""
from __future__ import annotations

import random

import numpy as np

from engine.block_manager import BlockManager
from engine.request import Request, SamplingParams
from engine.step_inputs import StepInputs, block_row


def test_block_row_follows_appends_trims_and_frees():
    bm = BlockManager(128, 4, enable_prefix_caching=False)
    req = Request("r", list(range(10)), SamplingParams(), 1)
    assert bm.allocate(req, req.num_tokens)
    bm.commit(req, req.num_tokens)
    rng = random.Random(0)
    kinds = set()

    def grow(n: int, room: int = 0) -> None:  # n tokens computed and kept, with blocks for `room` more (drafts)
        assert bm.allocate(req, n + room)
        req.token_ids += [5] * n
        bm.commit(req, n)

    for _ in range(400):
        op = rng.choice(["decode", "decode", "draft", "free"])
        if req.num_tokens > 300:
            op = "free"
        if op == "decode":
            grow(rng.randint(1, 9))
        elif op == "draft":
            # verification rejected drafts: the blocks past the kept tokens go, and the next step's appends may
            # follow before any step reads the table (a copy that only watched the length would keep stale ids)
            before = len(req.block_table)
            grow(1, room=rng.randint(4, 12))
            assert block_row(req).tolist() == req.block_table  # the verifying step reads it
            grown = len(req.block_table)
            bm.trim(req)
            if len(req.block_table) < grown:
                kinds.add("trimmed")
                if rng.random() < 0.7 and len(req.block_table) >= before:
                    grow(rng.randint(5, 9))
                    kinds.add("trimmed then appended")
        else:
            bm.free(req)
            req.token_ids = req.token_ids[:10]
            assert bm.allocate(req, req.num_tokens)
            bm.commit(req, req.num_tokens)
            kinds.add("freed")
        if rng.random() < 0.5:  # a step reads it (not after every change)
            assert block_row(req).tolist() == req.block_table
    assert block_row(req).tolist() == req.block_table
    assert kinds == {"trimmed", "trimmed then appended", "freed"}


def test_fill_writes_each_step_table_zero_past_its_blocks():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    reqs = [Request(f"r{i}", list(range(3 + 5 * i)), SamplingParams(), 1) for i in range(3)]
    for r in reqs:
        assert bm.allocate(r, r.num_tokens)
    inp = StepInputs(64, 4, 8, pin=False)
    inp.tables.fill_(7)  # what an earlier step left
    cu = inp.fill(reqs, [0] * 3, [r.token_ids for r in reqs], 4)
    bt = inp.block_tables.numpy()
    assert bt.shape == (3, max(len(r.block_table) for r in reqs)) and cu.tolist() == [0, 3, 11, 24]
    for row, r in zip(bt, reqs):
        assert row[: len(r.block_table)].tolist() == r.block_table and not row[len(r.block_table):].any()
    assert np.array_equal(inp.slot_mapping[:24].numpy() // 4,
                          np.concatenate([np.repeat(r.block_table, 4)[: r.num_tokens] for r in reqs]))
    assert inp.input_ids[:24].tolist() == [t for r in reqs for t in r.token_ids]
    assert inp.positions[:24].tolist() == [p for r in reqs for p in range(r.num_tokens)]
