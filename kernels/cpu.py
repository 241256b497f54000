"""CPU paths for the quantized linear layer, built on ATen's CPU low-bit GEMM ops (torch 2.13):

* `torch.ops.aten._weight_int8pack_mm(x[M, K], w int8 [N, K], scales[N] in x's dtype)`: per-channel int8 only.
* `torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K] in 0..15, innerKTiles=1)` -> uint8 [N, K/2]
  in a blocked layout, then `torch.ops.aten._weight_int4pack_mm_for_cpu(x[M, K], packed, group, sz)` with
  sz = scales_and_zeros [K / group, N, 2] in x's dtype and w = (q - 8) * sz[..., 0] + sz[..., 1].
  Needs N % 16 == 0, group in {32, 64, 128, 256}. Maps our formats exactly:
  int4_sym -> zero 0; int4_asym (q*d + m) -> zero = m + 8d; ternary (c - 1)*d -> code c + 7, zero 0.
* grouped int8 (GGUF Q8_0, Q5_0, Q5_1, Q5_K, IQ4_*: codes c in -128..127, w = c*d (+ m)) runs as two int4 planes in one
  int4pack call: c + 128 = 16*hi + lo, so w = (hi - 8)*16d + ((lo - 8)*d + 8d + m); the [2N, K] result rows are
  summed in pairs (`int8split_fn`).
* every other weight (groups of 16: GGUF Q6_K, Q2_K, Q3_K) is dequantized once into a dense copy in the compute
  dtype (`dense_fn`), cached on the weight.
* `native_fn`: a weight the engine marked `qw.cache["lowbit_native"]` (engine/model/linear.use_cpu_kernel: 4-bit or
  grouped int8, groups of 32k) runs its decode and verification rows (up to NATIVE_ROWS) through the C++ kernel of
  kernels/cpu_native.py, float32 in and out (activations rounded to int16 per block of 32, finer than the bf16 the
  ATen kernels take); more rows (a prompt) through the ATen path above.

Which path `kernels.dispatch.linear` takes on the CPU is decided by the measurements in docs/KERNELS.md.
The converted layouts are cached on the QuantizedWeight (`qw.cache`), keyed by purpose and activation dtype.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.quant import QuantizedWeight, codes, dequantize

INT4PACK_GROUPS = (32, 64, 128, 256)
# rows up to which a marked weight takes the C++ kernel (decode, verification of a draft, an expert's rows of a
# prompt); more go through the dense prompt path where it is on (engine/model/linear.dense_prefill_rows). Measured on a
# 2-core AVX-512 Xeon (docs/KERNELS.md): the dense bf16 matmul wins from ~24 rows; below, for int8 the C++ kernel beats
# ATen's packed kernel at every row count, for int4 the packed one is ~1.3x faster but keeps a second copy of each
# weight it touches (a prompt over a MoE model's experts doubled its memory)
NATIVE_ROWS = 24


def has_int8pack() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def has_int4pack() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def int8pack_supported(qw: QuantizedWeight) -> bool:
    return qw.format == "int8" and qw.group_size == qw.in_features and qw.mins is None and has_int8pack()


def int4pack_supported(qw: QuantizedWeight) -> bool:
    return (qw.format in ("int4_asym", "int4_sym", "ternary") and qw.group_size in INT4PACK_GROUPS
            and qw.out_features % 16 == 0 and has_int4pack())


def int8split_supported(qw: QuantizedWeight) -> bool:
    return (qw.format == "int8" and not int8pack_supported(qw) and qw.group_size in INT4PACK_GROUPS
            and qw.out_features % 16 == 0 and has_int4pack())


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _returning(op, n: int, cd: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> op(x as contiguous [M, K] rows in `cd`) as [..., n] in x's dtype: the few tensor ops a decode step's
    linear layer pays besides the GEMM itself (called ~120 times a token: no per-call lookups here)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.to(cd) if x.dtype != cd else x  # a fresh (contiguous) copy when the dtype changes
        y = op(rows.contiguous() if x.dim() == 2 else _flat(rows))
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
    return run


def int8pack_fn(qw: QuantizedWeight, cd: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ dequantize(qw).T through `_weight_int8pack_mm`, computed in `cd` (the weight's operands prepared)."""
    key = ("int8pack", cd)
    scales = qw.cache.get(key)
    if scales is None:
        scales = qw.cache[key] = qw.scales.reshape(-1).to(cd).contiguous()
    op, w = torch.ops.aten._weight_int8pack_mm.default, qw.qweight
    return _returning(lambda x: op(x, w, scales), qw.out_features, cd)


def int4pack_fn(qw: QuantizedWeight, cd: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ dequantize(qw).T through `_weight_int4pack_mm_for_cpu`, computed in `cd`."""
    packed, sz = int4pack_prepare(qw, cd)
    op, group = torch.ops.aten._weight_int4pack_mm_for_cpu.default, qw.group_size
    return _returning(lambda x: op(x, packed, group, sz), qw.out_features, cd)


def int8split_fn(qw: QuantizedWeight, cd: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ dequantize(qw).T for grouped int8 through one `_weight_int4pack_mm_for_cpu` call over its two
    4-bit planes (high nibbles then low nibbles of c + 128, stacked along the outputs), computed in `cd`."""
    key = ("int8split", cd)
    hit = qw.cache.get(key)
    if hit is None:
        u = (qw.qweight.to(torch.int32) + 128)
        planes = torch.cat((u >> 4, u & 15)).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(planes, 1)
        d = qw.scales.float()
        low_zero = 8 * d + (qw.mins.float() if qw.mins is not None else 0)
        scale = torch.cat((16 * d, d))
        zero = torch.cat((torch.zeros_like(d), low_zero))
        sz = torch.stack((scale.t(), zero.t()), dim=-1).to(cd).contiguous()
        hit = qw.cache[key] = (packed, sz)
    packed, sz = hit
    op, group, n = torch.ops.aten._weight_int4pack_mm_for_cpu.default, qw.group_size, qw.out_features

    def pairs(x: torch.Tensor) -> torch.Tensor:
        y = op(x, packed, group, sz)
        return y[:, :n] + y[:, n:]
    return _returning(pairs, n, cd)


def native_fn(qw: QuantizedWeight, many: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor],
                                                                                            torch.Tensor]:
    """x (float32) -> x @ dequantize(qw).T through the C++ kernel for up to NATIVE_ROWS rows, `many` for more."""
    op, n = cpu_native.lowbit_op(), qw.out_features
    operands = (qw.qweight, qw.scales, qw.mins, qw.format == "int4_sym")

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else _flat(x)
        if rows.shape[0] > NATIVE_ROWS:
            return many(x)
        y = op(rows, *operands)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
    return run


def dense_fn(qw: QuantizedWeight, cd: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> F.linear(x, W) over the weight dequantized once into `cd` (cached on the weight)."""
    key = ("dense", cd)
    w = qw.cache.get(key)
    if w is None:
        w = qw.cache[key] = dequantize(qw, cd)
    return _returning(lambda x: F.linear(x, w), qw.out_features, cd)


def int8pack_linear(x: torch.Tensor, qw: QuantizedWeight,
                    compute_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x @ dequantize(qw).T via `_weight_int8pack_mm` (per-channel int8). The op runs in `compute_dtype`
    (default x.dtype; fp32 activations are slow in ATen's kernel, bf16 fast: see docs/KERNELS.md); y in x.dtype."""
    return int8pack_fn(qw, compute_dtype or x.dtype)(x)


def int4pack_prepare(qw: QuantizedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales_and_zeros [K/group, N, 2] in `dtype`) for `_weight_int4pack_mm_for_cpu`, cached."""
    key = ("int4pack", dtype)
    hit = qw.cache.get(key)
    if hit is not None:
        return hit
    packed = qw.cache.get("int4pack_w")
    if packed is None:
        c = codes(qw).to(torch.int32)
        if qw.format == "ternary":
            c = c + 7
        packed = qw.cache["int4pack_w"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1)
    d = qw.scales.float()
    zero = qw.mins.float() + 8 * d if qw.format == "int4_asym" else torch.zeros_like(d)
    sz = torch.stack((d.t(), zero.t()), dim=-1).to(dtype).contiguous()
    qw.cache[key] = (packed, sz)
    return packed, sz


def int4pack_linear(x: torch.Tensor, qw: QuantizedWeight,
                    compute_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x @ dequantize(qw).T via `_weight_int4pack_mm_for_cpu` (int4_asym, int4_sym, ternary), run in
    `compute_dtype` (default x.dtype); y in x.dtype."""
    return int4pack_fn(qw, compute_dtype or x.dtype)(x)


def dequant_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """y = F.linear(x, dequantize(qw)) with the weight dequantized on every call (no dense copy kept)."""
    return F.linear(x, dequantize(qw, x.dtype))
