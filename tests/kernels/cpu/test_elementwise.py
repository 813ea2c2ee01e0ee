"""The native CPU rms_norm, rotary_embedding, store_kv and silu_and_mul equal their torch twins, in every dtype,
on one row and on enough rows to run threaded; bad positions and slots are refused before anything is written."""
from __future__ import annotations

import pytest
import torch

from sluice_kernels import reference
from sluice_kernels.cpu import elementwise
from sluice_kernels.cpu.binding import Native
from tests.kernels.common import DTYPES

# Same roundings as the twins, so the only differences are fp32 summation order and exp: ~1 ulp of the dtype.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}
ROWS = [1, 7, 300]  # 300 x 512 elements takes the threaded path


@pytest.fixture(params=["native", "no-avx512"])
def lib(request, native_builds) -> Native:
    if request.param not in native_builds:
        pytest.skip("x86-only build variant")
    return native_builds[request.param]


def _randn(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_with_and_without_residual(lib, dtype, rows):
    x, r, w = _randn(rows, 512, dtype=dtype), _randn(rows, 512, dtype=dtype, seed=1), _randn(512, dtype=dtype, seed=2)
    torch.testing.assert_close(elementwise.rms_norm(x, w, 1e-6, lib=lib), reference.rms_norm(x, w, 1e-6), **TOL[dtype])
    out, res = elementwise.rms_norm(x, w, 1e-6, r, lib=lib)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)  # the residual add is one rounding: exact
    assert res.data_ptr() != r.data_ptr()  # inputs are not modified


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot_dim", [64, 32], ids=["full", "partial"])
def test_rotary_in_place(lib, dtype, rows, neox, rot_dim):
    q, k = _randn(rows, 8, 64, dtype=dtype), _randn(rows, 2, 64, dtype=dtype, seed=1)
    pos = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(3))
    ang = torch.outer(torch.arange(4096, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, rot_dim, 2) / rot_dim))
    cs = torch.cat((ang.cos(), ang.sin()), -1)
    rq, rk = reference.rotary_embedding(pos, q.clone(), k.clone(), cs, neox)
    oq, ok = elementwise.rotary_embedding(pos, q, k, cs, neox, lib=lib)
    assert oq.data_ptr() == q.data_ptr() and ok.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, rq, **TOL[dtype])
    torch.testing.assert_close(k, rk, **TOL[dtype])


def test_rotary_refuses_a_position_past_the_cache_and_rotates_nothing(lib):
    q, k = _randn(3, 2, 16, dtype=torch.float32), _randn(3, 1, 16, dtype=torch.float32)
    cs = torch.ones(10, 16)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(IndexError, match="rotary cache of 10"):
        elementwise.rotary_embedding(torch.tensor([0, 10, 2]), q, k, cs, lib=lib)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # nothing rotated


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_slots_and_skips_minus_one(lib, dtype):
    k, v = _randn(5, 2, 16, dtype=dtype), _randn(5, 2, 16, dtype=dtype, seed=1)
    slots = torch.tensor([3, -1, 17, 0, 31])
    caches = [torch.zeros(4, 8, 2, 16, dtype=dtype) for _ in range(4)]
    reference.store_kv(k, v, caches[0], caches[1], slots)
    elementwise.store_kv(k, v, caches[2], caches[3], slots, lib=lib)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].view(-1, 2, 16).abs().sum((1, 2)).nonzero().flatten().tolist() == [0, 3, 17, 31]


def test_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing(lib):
    k = _randn(2, 1, 8, dtype=torch.float32)
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(IndexError, match="8 slots"):
        elementwise.store_kv(k, k, kc, vc, torch.tensor([1, 8]), lib=lib)
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(lib, dtype, rows):
    x = _randn(rows, 2 * 512, dtype=dtype) * 4  # wide range: exp's clamps are reached
    torch.testing.assert_close(elementwise.silu_and_mul(x, lib=lib), reference.silu_and_mul(x), **TOL[dtype])


def test_silu_and_mul_refuses_an_odd_width_as_the_twin_does(lib):
    """Rows of 2d + 1 would otherwise be read with a stride of 2d: wrong numbers, no error."""
    with pytest.raises(RuntimeError, match="must match"):
        elementwise.silu_and_mul(torch.randn(3, 9), lib=lib)
