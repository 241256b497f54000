"""Triton: quantize this step's K or V rows and write them into their KV-cache pages (quantize-on-write).

Twin: `engine.memory.kv.quant.quantize` followed by `index_copy_` into the page slots (engine/memory/kv/cache.py). The format is
docs/KV.md's: symmetric, round half to even, per (token, head) int8 with one fp16 scale, or int4 in groups of G
channels with one fp16 scale per group, two codes a byte (element 2j in the low nibble), code = q + 8. Scales:
absmax / 127 (int8) or / 7.5 (int4), times (1 + 2^-10), clamped to [2^-14, 65504], then rounded to fp16; codes are
x / scale (IEEE division, as the twin) rounded half to even. One program per (token, head); D and G powers of two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    r = tl.floor(y)
    f = y - r  # exact for |y| < 2^23
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _kv_quant_write_kernel(x_ptr, slot_ptr, code_ptr, scale_ptr, stride_xt, stride_xh, H,
                           D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    NG: tl.constexpr = D // G
    slot = tl.load(slot_ptr + t).to(tl.int64)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + tl.arange(0, D)).to(tl.float32)
    xg = tl.reshape(x, (NG, G))
    amax = tl.max(tl.abs(xg), axis=1)
    if BITS == 8:
        s = amax / 127.0
    else:
        s = amax / 7.5
    s = tl.minimum(tl.maximum(s * (1.0 + 1.0 / 1024.0), 1.0 / 16384.0), 65504.0)
    s16 = s.to(tl.float16)
    y = tl.math.div_rn(xg, s16.to(tl.float32)[:, None])
    row = slot * H + h
    tl.store(scale_ptr + row * NG + tl.arange(0, NG), s16)
    if BITS == 8:
        q = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0)
        tl.store(code_ptr + row * D + tl.arange(0, D), tl.reshape(q, (D,)).to(tl.int8))
    else:
        q = tl.minimum(tl.maximum(_round_half_even(y), -8.0), 7.0)
        c = (tl.reshape(q, (D,)) + 8.0).to(tl.int32)
        lo, hi = tl.split(tl.reshape(c, (D // 2, 2)))
        tl.store(code_ptr + row * (D // 2) + tl.arange(0, D // 2), (lo | (hi << 4)).to(tl.uint8))


def supported(head_dim: int, group: int) -> bool:
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0 and group & (group - 1) == 0


def kv_quant_write(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int,
                   group: int) -> None:
    """x [T, H, D] float rows -> codes/scales of one layer ([pages, page, H, D or D/2] and [pages, page, H, D/G]),
    at flat slots [T] (page * page_size + offset)."""
    T, H, D = x.shape
    if not supported(D, group):
        raise ValueError(f"kv_quant_write needs a power-of-two head_dim and group, got {D} and {group}")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("the KV code and scale tensors must be contiguous")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if T:
        _kv_quant_write_kernel[(T, H)](x, slots.contiguous(), codes, scales, x.stride(0), x.stride(1), H,
                                       D=D, G=group, BITS=bits, num_warps=1 if D <= 128 else 2)
