"""Triton `rotary_embedding` equals `reference.rotary_embedding` for neox and GPT-J layouts, full and
partial rotary dims, in place on strided q/k views of a fused qkv tensor."""
from __future__ import annotations

import pytest
import torch

from sluice_kernels import reference
from sluice_kernels.triton import rotary
from tests.kernels.common import DEVICE, DTYPES, TOLERANCES


def _cos_sin(max_pos: int, rot_dim: int, dtype) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]  # (max_pos, rot_dim/2)
    return torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot_dim", [32, 16, 12])  # 12 of 32: partial rotary with a padded half
def test_matches_reference_in_place(dtype, is_neox, rot_dim):
    g = torch.Generator().manual_seed(2)
    T, Hq, Hkv, D = 5, 6, 2, 32
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=g).to(dtype).to(DEVICE)
    q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv]
    v_before = qkv[:, Hq + Hkv:].clone()
    positions = torch.tensor([0, 7, 3, 63, 8], dtype=torch.int64, device=DEVICE)
    cs = _cos_sin(64, rot_dim, torch.float32)
    q_ref, k_ref = reference.rotary_embedding(positions, q.clone(), k.clone(), cs, is_neox)
    q_out, k_out = rotary.rotary_embedding(positions, q, k, cs, is_neox)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, q_ref, **TOLERANCES[dtype])
    torch.testing.assert_close(k, k_ref, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, Hq + Hkv:], v_before)  # v, sharing the buffer, is untouched


def test_half_cache_and_int32_positions():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 16, generator=g).to(DEVICE)
    k = torch.randn(3, 1, 16, generator=g).to(DEVICE)
    positions = torch.tensor([1, 2, 30], dtype=torch.int32, device=DEVICE)
    cs = _cos_sin(32, 16, torch.float16)
    q_ref, k_ref = reference.rotary_embedding(positions, q.clone(), k.clone(), cs)
    rotary.rotary_embedding(positions, q, k, cs)
    torch.testing.assert_close(q, q_ref, **TOLERANCES[torch.float32])
    torch.testing.assert_close(k, k_ref, **TOLERANCES[torch.float32])
