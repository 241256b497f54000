"""Triton: dequantizing GEMM for every `QuantizedWeight` format, and `dequantize_to` (dense weight for cuBLAS prefill).

Twins: `kernels.reference.quant_linear_ref` (x.float() @ dequantize(qw).T, cast to x.dtype) and
`kernels.quant.dequantize`.

One kernel, parameterized by the format (constexpr FMT), reads the packed weight directly:
  program (pid_m, pid_n) owns y[BLOCK_M rows, BLOCK_N outputs]; it walks in_features in BLOCK_K steps, decodes the
  [BLOCK_N, BLOCK_K] weight tile to float32 (codes -> value, scale/min gathered per column's group; per-channel
  int8 instead scales the accumulator once at the end), and
  * BLOCK_M == 1 (decode, batch 1): multiply-and-reduce on the vector units (no padding waste);
  * BLOCK_M >= 16 (decode batch 2..8 padded to 16, and prefill tiles): tl.dot on the tile.
Everything is float32 after the loads; tl.dot uses "ieee" for float32 activations and "tf32" for half ones (the
half activations are exact in tf32; the decoded weight is rounded to tf32's 10-bit mantissa, well inside bf16/fp16
output tolerances).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted
from kernels.quant import QuantizedWeight

FMT_CODE = {"int8": 0, "int4_asym": 1, "int4_sym": 2, "ternary": 3}
INT8_WITH_MINS = 4  # int8 codes plus a min per group (GGUF Q5_1, Q5_K)


def fmt_code(qw: QuantizedWeight) -> int:
    return INT8_WITH_MINS if qw.format == "int8" and qw.mins is not None else FMT_CODE[qw.format]


@triton.jit
def _decode_tile(w_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, stride_wn, stride_sn, GROUP,
                 FMT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K] tile of the weight (rows offs_n, columns offs_k); 0 outside [N, K].
    PER_CHANNEL (int8 with one scale per row): the scale is left out here and applied to the accumulator.
    Offsets are int32: the wrapper checks that the packed weight and the scales have fewer than 2**31 elements."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = offs_n[:, None] * stride_wn
    if FMT == 0 or FMT == 4:  # int8: q
        q = tl.load(w_ptr + rows + offs_k[None, :], mask=mask, other=0).to(tl.float32)
    elif FMT == 3:  # ternary: 4 codes per byte, value = code - 1
        byte = tl.load(w_ptr + rows + (offs_k // 4)[None, :], mask=mask, other=0).to(tl.int32)
        q = (((byte >> ((offs_k % 4) * 2)[None, :]) & 3) - 1).to(tl.float32)
    else:  # int4: 2 codes per byte, element 2j low nibble
        byte = tl.load(w_ptr + rows + (offs_k // 2)[None, :], mask=mask, other=0).to(tl.int32)
        q = (byte >> ((offs_k % 2) * 4)[None, :]) & 15
        if FMT == 2:  # int4_sym: q - 8
            q = q - 8
        q = q.to(tl.float32)
    if PER_CHANNEL:
        w = q
    else:
        g = offs_n[:, None] * stride_sn + (offs_k // GROUP)[None, :]
        w = q * tl.load(s_ptr + g, mask=mask, other=0).to(tl.float32)
        if FMT == 1 or FMT == 4:  # int4_asym, int8 with mins: + min
            w = w + tl.load(m_ptr + g, mask=mask, other=0).to(tl.float32)
    return w


@triton.jit
def _qgemm_kernel(x_ptr, w_ptr, s_ptr, m_ptr, y_ptr, M, N, K, stride_xm, stride_ym, stride_wn, stride_sn, GROUP,
                  FMT: tl.constexpr, PER_CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = _decode_tile(w_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, stride_wn, stride_sn, GROUP, FMT, PER_CHANNEL)
            x = tl.load(x_row + offs_k, mask=offs_k < K, other=0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if PER_CHANNEL:
            acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=offs_n < N, other=0).to(tl.float32)
        tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_m = offs_m[:, None].to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = _decode_tile(w_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, stride_wn, stride_sn, GROUP, FMT, PER_CHANNEL)
            x = tl.load(x_ptr + rows_m * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0).to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if PER_CHANNEL:
            acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=offs_n < N, other=0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows_m * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, m_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, GROUP,
                    FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _decode_tile(w_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, stride_wn, stride_sn, GROUP, FMT, False)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


DEQUANT_BLOCKS = (32, 128)  # (BLOCK_N, BLOCK_K) on a GPU: no spills on sm_90


def launch_blocks(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). Under the interpreter the cost is per program instance: big tiles.
    On a GPU: not timed (no GPU was available); chosen as the largest tiles that compile for sm_90 without register
    spills for every format (ptxas -v, docs/KERNELS.md)."""
    if is_interpreted(_qgemm_kernel):
        bm = 1 if M == 1 else max(16, min(64, triton.next_power_of_2(M)))
        return bm, max(16, min(256, triton.next_power_of_2(N))), max(16, min(512, triton.next_power_of_2(K))), 4
    if M == 1:
        return 1, 16, 256, 4
    if M <= 16:
        return 16, 32, 128, 4
    return 64, 64, 64, 8


def _check_int32(qw: QuantizedWeight) -> None:
    if qw.qweight.numel() >= 2 ** 31 or not qw.qweight.is_contiguous() or not qw.scales.is_contiguous():
        raise ValueError("the Triton kernels need a contiguous packed weight of fewer than 2**31 elements")


def qlinear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize(qw).T (+ bias) for x [..., in_features] of float32/bf16/fp16; y in x.dtype."""
    _check_int32(qw)
    N, K = qw.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {K}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        bm, bn, bk, warps = launch_blocks(M, N, K)
        prec = "ieee" if x.dtype == torch.float32 or is_interpreted(_qgemm_kernel) else "tf32"
        mins = qw.mins if qw.mins is not None else qw.scales
        grid = (M if bm == 1 else triton.cdiv(M, bm), triton.cdiv(N, bn))
        _qgemm_kernel[grid](x2, qw.qweight, qw.scales, mins, y, M, N, K, x2.stride(0), y.stride(0),
                            qw.qweight.stride(0), qw.scales.stride(0), qw.group_size, FMT=fmt_code(qw),
                            PER_CHANNEL=qw.num_groups == 1 and qw.mins is None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=prec, num_warps=warps)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], N)


def dequantize_to(qw: QuantizedWeight, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Dense [out, in] weight in `dtype` (e.g. for a cuBLAS GEMM over a long prefill chunk)."""
    _check_int32(qw)
    N, K = qw.shape
    out = torch.empty(N, K, dtype=dtype, device=qw.device)
    if is_interpreted(_dequant_kernel):
        bn, bk = max(16, min(256, triton.next_power_of_2(N))), max(16, min(512, triton.next_power_of_2(K)))
    else:
        bn, bk = DEQUANT_BLOCKS
    mins = qw.mins if qw.mins is not None else qw.scales
    grid = (triton.cdiv(N, bn), triton.cdiv(K, bk))
    _dequant_kernel[grid](qw.qweight, qw.scales, mins, out, N, K, qw.qweight.stride(0), qw.scales.stride(0),
                          out.stride(0), qw.group_size, FMT=fmt_code(qw), BLOCK_N=bn, BLOCK_K=bk)
    return out
