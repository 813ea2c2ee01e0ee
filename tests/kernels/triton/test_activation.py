"""Triton `silu_and_mul` equals `reference.silu_and_mul` for any leading shape and widths that span
several programs per row."""
from __future__ import annotations

import pytest
import torch

from sluice_kernels import reference
from sluice_kernels.triton import activation
from tests.kernels.common import DEVICE, DTYPES, TOLERANCES


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 2 * 40), (2, 3, 2 * 64), (2, 2 * 1100)])  # 1100: two chunks a row
def test_matches_reference(dtype, shape):
    x = (2 * torch.randn(shape, generator=torch.Generator().manual_seed(4))).to(dtype).to(DEVICE)
    out = activation.silu_and_mul(x)
    ref = reference.silu_and_mul(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
