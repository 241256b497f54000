"""Linear layers over dense or low-bit weights, and the policy that turns loaded tensors into a weight format.

Formats (`--weight-dtype`): fp32/bf16/fp16 dense; int8 per output channel; int4 in groups of 32 (GGUF Q4_0/Q4_1 kept
as stored, without requantizing); ternary ({-1,0,+1} x group scale). The matmuls go through kernels.dispatch: Triton on
CUDA, ATen's int8/int4 pack kernels on the CPU."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels import dispatch
from kernels.quant import QuantizedWeight, dequantize, quantize_int4, quantize_int8, quantize_ternary

log = logging.getLogger("ninfer.model")

DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOW_BIT = ("int8", "int4", "ternary")
INT4_GROUP, TERNARY_GROUP = 32, 64
Weight = torch.Tensor | QuantizedWeight
FEW_ROWS, WIDE_OUT = 16, 16384  # see Linear.__call__


def is_linear(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def native_format(tensors: dict[str, Weight]) -> str | None:
    """The low-bit format most linear weights are stored in (as loaded from a GGUF file), if any."""
    kinds = [t.format for n, t in tensors.items() if is_linear(n) and isinstance(t, QuantizedWeight)]
    if not kinds:
        return None
    top = max(set(kinds), key=kinds.count)
    return {"int4_asym": "int4", "int4_sym": "int4", "int8": "int8", "ternary": "ternary"}[top]


def convert(name: str, t: Weight, fmt: str, dtype: torch.dtype, device: torch.device) -> Weight:
    """One tensor in the format the model runs: dense tensors for norms/embeddings, `fmt` for linear weights.
    The output layer of a low-bit model is int8 per channel (it reads the same bytes as the embedding's Q8_0)."""
    if fmt not in LOW_BIT or not is_linear(name):
        dense = dequantize(t, torch.float32) if isinstance(t, QuantizedWeight) else t
        return dense.to(device=device, dtype=dtype)
    want = "int8" if name == "lm_head.weight" else fmt
    if isinstance(t, QuantizedWeight) and _matches(t, want):
        return t.to(device)
    dense = (dequantize(t, torch.float32) if isinstance(t, QuantizedWeight) else t).float()
    if want == "int8":
        q = quantize_int8(dense)
    elif want == "int4":
        q = quantize_int4(dense, INT4_GROUP, symmetric=False)
    else:
        q = quantize_ternary(dense, TERNARY_GROUP)
    return q.to(device)


def _matches(t: QuantizedWeight, want: str) -> bool:
    if want == "int8":
        return t.format == "int8" and t.group_size == t.in_features  # per channel: the CPU fast path needs it
    return t.format.startswith(want)


def fuse(parts: list[Weight]) -> Weight:
    """Stacks weights along the output dimension so q/k/v (or gate/up) run as one matmul."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    same = all(isinstance(p, QuantizedWeight) and p.format == first.format and p.group_size == first.group_size
               and p.scales.dtype == first.scales.dtype for p in parts)
    if not same:  # mixed storage (e.g. a GGUF with Q6_K beside Q4_1): requantize to the first one's format
        fmt = {"int4_asym": "int4", "int4_sym": "int4"}.get(first.format, first.format)
        parts = [p if isinstance(p, QuantizedWeight) and p.format == first.format
                 else convert("x_proj.weight", p, fmt, torch.float32, first.device) for p in parts]
        log.info("requantized a mixed-format fused weight to %s", first.format)
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return QuantizedWeight(first.format, cat([p.qweight for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), first.group_size,
                           (sum(p.out_features for p in parts), first.in_features))


class Linear:
    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if isinstance(w, QuantizedWeight):
            return dispatch.linear(x, w, self.bias)
        if x.device.type == "cpu" and 1 < x.shape[0] <= FEW_ROWS and w.shape[0] >= WIDE_OUT and x.dim() == 2:
            # a few rows through a wide layer (the output layer over a verified draft): the CPU BLAS reads W
            # several times as x @ W.T at 2-3 rows, once as W @ x.T (measured: 23 ms vs 6 ms, 49152 x 576 fp32)
            y = (w @ x.t()).t()
            return y if self.bias is None else y + self.bias
        return F.linear(x, w, self.bias)

    @property
    def nbytes(self) -> int:
        w = self.weight
        n = w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
