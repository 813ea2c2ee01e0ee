"""SwiGLU gate: `silu(x[..., :d]) * x[..., d:]` for x `[..., 2d]`, one program per (row, chunk).

Rounds where the reference does: silu's result is rounded to x's dtype before the multiply.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [N, d]
    x_ptr,  # [N, 2d]
    stride_xn, stride_on, d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_xn + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_xn + d + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_on + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2d] -> [..., d]
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # (N, 2d)
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and d > 0:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            out, x2, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], d)


__all__ = ["silu_and_mul"]
