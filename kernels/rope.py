"""Triton: rotary position embedding, half-split (NeoX/HF) layout: out = x*cos + rotate_half(x)*sin.

Twin: `kernels.reference.rope_ref`. Layout: x [T, H, D] (last dim contiguous), positions int [T], cos/sin
[max_position, D/2] (float32 tables as engine/model/layers.py's Rotary keeps them, scaling already applied).
One program per token holds all heads' [H, D/2] halves; float32 math, one rounding to x.dtype. out may be x
(in place).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, H, HALF, stride_xt, stride_xh, stride_ot, stride_oh,
                 stride_c, stride_s, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < H) & d_mask[None, :]
    c = tl.load(cos_ptr + pos * stride_c + offs_d, mask=d_mask, other=0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_s + offs_d, mask=d_mask, other=0).to(tl.float32)[None, :]
    xp = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(xp, mask=mask, other=0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0).to(tl.float32)
    op = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(op, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(op + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    T, H, D = x.shape
    if D % 2 or cos.shape[-1] != D // 2 or sin.shape[-1] != D // 2:
        raise ValueError(f"head dim {D} needs cos/sin tables of width {D // 2}, got {cos.shape[-1]}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)
    if T:
        _rope_kernel[(T,)](x, positions.contiguous(), cos, sin, out, H, D // 2, x.stride(0), x.stride(1),
                           out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
                           BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D // 2), num_warps=4)
    return out
