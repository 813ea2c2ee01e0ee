"""RMSNorm with an optional fused residual add, one program per row.

Rounds exactly where `reference.rms_norm` does: the sum `x + residual` and the normalised row are
rounded to x's dtype before the weight multiply; statistics are fp32. Inputs are never modified.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H] in promote(x.dtype, weight.dtype)
    new_residual_ptr,  # [T, H] x.dtype, = x + residual (HAS_RESIDUAL)
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (HAS_RESIDUAL)
    weight_ptr,  # [H]
    eps,
    stride_xt, stride_rt, stride_ot, stride_nt,
    H: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0)
    x_dt = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rt + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(x_dt)
        tl.store(new_residual_ptr + row * stride_nt + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    normed = (x * rstd).to(x_dt).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H] (any leading dims)
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    assert weight.shape == (H,) and weight.is_contiguous(), (x.shape, weight.shape)
    assert x.stride(-1) == 1, "x's last dim must be contiguous"
    x2 = x.reshape(-1, H)  # (T, H)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        assert residual.stride(-1) == 1, "residual's last dim must be contiguous"
        r2 = residual.reshape(-1, H)
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r2 = new_res = x2  # unused by the kernel
    T = x2.shape[0]
    if T > 0:
        _rms_norm_kernel[(T,)](
            out, new_res, x2, r2, weight, eps,
            x2.stride(0), r2.stride(0), H, H,
            H=H, BLOCK_H=triton.next_power_of_2(H), HAS_RESIDUAL=residual is not None,
            num_warps=4 if H <= 2048 else 8,
        )
    return out if residual is None else (out, new_res)


__all__ = ["rms_norm"]
