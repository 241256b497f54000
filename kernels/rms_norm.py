"""Triton: fused RMSNorm, optionally with the residual add in front (returns (normed, new_residual)).

Twin: `kernels.reference.rms_norm_ref` (HF Llama semantics: statistics in float32, the normalized row cast to
x.dtype before the weight multiply). Layout: x [..., N] (rows contiguous in the last dim), weight [N]; one program
per row with the whole row in one block (N up to a few thousand), everything float32 after the loads.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, N, stride_x, stride_r, stride_o, stride_res, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0).to(tl.float32)
        h = x.to(res_ptr.dtype.element_ty)  # the new residual, rounded as the twin's x + residual
        tl.store(res_ptr + row * stride_res + offs, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    n = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # the twin casts the normalized row to x.dtype
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * n).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """normed = weight * rmsnorm(x [+ residual]); with `residual` returns (normed, x + residual)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, N)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        r2 = res = x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight.contiguous(), out, res, N, x2.stride(0), r2.stride(0),
                                         out.stride(0), res.stride(0), float(eps), HAS_RES=residual is not None,
                                         BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8)
    out = out.reshape(*x.shape[:-1], N)
    return out if residual is None else (out, res.reshape(*x.shape[:-1], N))
