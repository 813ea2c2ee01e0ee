"""Triton `rms_norm` (plain and with the fused residual add) equals `reference.rms_norm`, rounding
where it rounds; the inputs are never modified and the output dtype follows torch promotion."""
from __future__ import annotations

import pytest
import torch

from sluice_kernels import reference
from sluice_kernels.triton import norm
from tests.kernels.common import DEVICE, DTYPES, TOLERANCES


def _inputs(shape, dtype, w_dtype=None):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)
    r = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(w_dtype or dtype).to(DEVICE)
    return x, r, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 96), (1, 1000)])  # 1000: padded row, masked
def test_plain(dtype, shape):
    x, _, w = _inputs(shape, dtype)
    x0 = x.clone()
    out = norm.rms_norm(x, w, 1e-6)
    ref = reference.rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_residual(dtype):
    x, r, w = _inputs((6, 80), dtype)
    x0, r0 = x.clone(), r.clone()
    out, new_res = norm.rms_norm(x, w, 1e-5, r)
    ref, ref_res = reference.rms_norm(x, w, 1e-5, r)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    torch.testing.assert_close(new_res, ref_res, **TOLERANCES[dtype])
    if dtype != torch.bfloat16:  # the interpreter truncates fp32 -> bf16 instead of rounding
        assert torch.equal(new_res, ref_res)
    assert torch.equal(x, x0) and torch.equal(r, r0)


def test_fp32_weight_on_half_input_promotes():
    x, r, w = _inputs((4, 32), torch.float16, w_dtype=torch.float32)
    out, _ = norm.rms_norm(x, w, 1e-6, r)
    ref, _ = reference.rms_norm(x, w, 1e-6, r)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # normalised row rounds to fp16 in both
