"""Triton paged attention equals `reference.paged_attention` on every batch shape the engine makes:
decodes, chunks over a cached context, whole prompts, all mixed in one launch, with and without
split-KV, over shuffled blocks, for GQA ratios 1/4/8, several block sizes, head dims and dtypes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice_kernels import reference
from sluice_kernels.triton import attention
from tests.kernels.common import DEVICE, DTYPES, TOLERANCES, paged_batch

# (q_len, cached) per sequence; block size 8 makes most of them cross block boundaries.
DECODES = ([1, 1, 1], [0, 8, 22])  # a sequence's very first token (empty context) is a decode too
CHUNK = ([11], [13])  # a prefill chunk over a cached prefix, starting mid-block
PROMPT = ([19], [0])  # a whole prompt, empty cached context
MIXED = ([1, 7, 1, 12, 1], [30, 9, 0, 0, 16])


def _check(batch, scale: float = 0.3, **kw) -> None:
    out = attention.paged_attention(*batch.args(), scale, **kw)
    ref = reference.paged_attention(*batch.args(), scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[batch.q.dtype])


@pytest.mark.parametrize("kind", ["decodes", "chunk", "prompt", "mixed"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_batch_kinds_and_gqa(kind, heads):
    q_lens, cached = {"decodes": DECODES, "chunk": CHUNK, "prompt": PROMPT, "mixed": MIXED}[kind]
    hq, hkv = heads
    _check(paged_batch(q_lens, cached, num_q_heads=hq, num_kv_heads=hkv, head_dim=32, block_size=8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes(dtype):
    _check(paged_batch(*MIXED, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype))


@pytest.mark.parametrize("block_size", [8, 32, 128])
@pytest.mark.parametrize("head_dim", [16, 40, 64])  # 40: padded to 64 and masked
def test_block_sizes_and_head_dims(block_size, head_dim):
    _check(paged_batch(*MIXED, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=block_size))


@pytest.mark.parametrize("block_n", [16, 32])
def test_many_kv_tiles(block_n):
    """Small KV tiles: many unmasked tiles, then a masked tail that straddles the causal diagonal."""
    _check(paged_batch([1, 9, 40], [70, 45, 3], num_q_heads=4, num_kv_heads=1, head_dim=16, block_size=8),
           block_n=block_n)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("kind", ["decodes", "mixed"])
def test_split_kv(num_splits, kind):
    """Forced split-KV: some splits hold no visible key for some rows (short sequences, early rows)."""
    q_lens, cached = ([1, 1, 1], [0, 37, 70]) if kind == "decodes" else ([1, 5, 1, 9], [60, 30, 2, 0])
    _check(paged_batch(q_lens, cached, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8),
           num_splits=num_splits, block_n=16)


def test_split_kv_chosen_for_long_decodes():
    """A decode batch too small to fill the GPU gets split-KV from the launcher by itself."""
    b = paged_batch([1, 1], [1100, 300], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=32)
    assert attention._choose_splits(True, 2 * 2, b.block_tables.shape[1] * 32, b.q.device) > 1
    assert attention._choose_splits(False, 2 * 2, b.block_tables.shape[1] * 32, b.q.device) == 1
    _check(b)


def test_empty_sequence_in_batch_and_strided_q():
    """A sequence with no new tokens is skipped; q may be a strided view into a fused qkv tensor."""
    b = paged_batch([3, 0, 1], [4, 7, 9], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    qkv = torch.randn(b.q.shape[0], 8, 16, device=DEVICE)  # (T, Hq + 2*Hkv, D)
    qkv[:, :4] = b.q
    b.q = qkv[:, :4]
    assert not b.q.is_contiguous()
    _check(b)


def test_rejects_bad_metadata():
    b = paged_batch(*CHUNK, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    with pytest.raises(AssertionError, match="int32"):
        attention.paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables.long(), b.cu_seqlens_q, b.seq_lens, 1.0)
    with pytest.raises(AssertionError, match="multiple"):
        attention.paged_attention(b.q[:, :3], b.k_cache, b.v_cache, *b.args()[3:], 1.0)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), min_size=1, max_size=4),
    block_size=st.sampled_from([8, 16]),
    group=st.sampled_from([1, 2, 4, 8]),
    num_splits=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(seqs, block_size, group, num_splits, seed):
    seqs = [(max(q, 1) if c == 0 else q, c) for q, c in seqs]  # a sequence holds >= 1 token
    q_lens, cached = [q for q, _ in seqs], [c for _, c in seqs]
    b = paged_batch(q_lens, cached, num_q_heads=group, num_kv_heads=1, head_dim=16, block_size=block_size,
                    seed=seed)
    _check(b, num_splits=num_splits, block_n=16)
