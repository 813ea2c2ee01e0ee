"""Triton `store_kv` writes exactly what `reference.store_kv` writes: slot -1 skips the row, every
other cache row stays untouched, k/v may be strided views of a fused qkv projection."""
from __future__ import annotations

import pytest
import torch

from sluice_kernels import reference
from sluice_kernels.triton import cache
from tests.kernels.common import DEVICE, DTYPES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_matches_reference_and_skips_minus_one(dtype, slot_dtype):
    g = torch.Generator().manual_seed(0)
    T, Hkv, D, num_blocks, bs = 7, 2, 24, 5, 8
    qkv = torch.randn(T, 4 + 2 * Hkv, D, generator=g).to(dtype).to(DEVICE)  # (T, Hq + 2*Hkv, D)
    k, v = qkv[:, 4:4 + Hkv], qkv[:, 4 + Hkv:]
    slots = torch.tensor([3, -1, 17, 8, -1, 39, 0], dtype=slot_dtype, device=DEVICE)  # crosses blocks
    k_cache = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    cache.store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    flat = k_cache.view(-1, Hkv, D)
    assert torch.equal(flat[17], k[2]) and torch.equal(flat[39], k[5])


def test_converts_to_cache_dtype():
    k = torch.randn(3, 1, 16, device=DEVICE)
    k_cache = torch.zeros(2, 4, 1, 16, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    cache.store_kv(k, -k, k_cache, v_cache, torch.tensor([5, -1, 2], device=DEVICE))
    assert torch.equal(k_cache.view(-1, 1, 16)[5], k[0].half())
    assert torch.equal(v_cache.view(-1, 1, 16)[2], -k[2].half())
    assert int((k_cache != 0).any(-1).sum()) == 2


def test_all_skipped_and_empty():
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    k = torch.ones(2, 1, 16, device=DEVICE)
    cache.store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([-1, -1], device=DEVICE))
    cache.store_kv(k[:0], k[:0], k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert not k_cache.any()
