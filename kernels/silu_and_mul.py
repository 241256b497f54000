"""Triton: SiLU-and-mul for the gated MLP: [..., 2N] -> [..., N], silu(gate) * up with gate = first half.

Twin: `kernels.reference.silu_and_mul_ref` (float32 math, one rounding). Program (row, block of N columns).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    N2 = x.shape[-1]
    if N2 % 2:
        raise ValueError(f"last dim {N2} is not even")
    N = N2 // 2
    x2 = x.reshape(-1, N2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(N)
    if not is_interpreted(_silu_and_mul_kernel):
        block = min(1024, block)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(N, block))](x2, out, N, x2.stride(0), out.stride(0),
                                                                   BLOCK=block, num_warps=4)
    return out.reshape(*x.shape[:-1], N)
