"""Random low-bit weights built on the device, for the synthetic models of scripts/gpu_check.sh."""
from __future__ import annotations

import torch

from kernels.quant import QuantizedWeight

GIB = 2**30
BITS = {"int8": 8.25, "int4_asym": 5.0, "ternary": 2.25}  # stored bits per weight, scales included


def random_weight(fmt: str, out_f: int, in_f: int, device: torch.device):
    """A QuantizedWeight of random codes and scales, built on the device (never all zeros)."""
    group = {"int8": in_f, "int4_asym": 32, "ternary": 64}[fmt]
    per_byte = {"int8": 1, "int4_asym": 2, "ternary": 4}[fmt]
    if fmt == "int8":
        q = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, device=device)
    elif fmt == "ternary":  # 2-bit codes 0..2 (3 is not a ternary value), four to a byte
        c = torch.randint(0, 3, (out_f, in_f // 4, 4), dtype=torch.uint8, device=device)
        q = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    else:
        q = torch.randint(0, 256, (out_f, in_f // per_byte), dtype=torch.uint8, device=device)
    groups = in_f // group
    scale_dtype = torch.float32 if fmt == "int8" else torch.float16
    scales = (torch.rand(out_f, groups, device=device) * 0.02 + 0.001).to(scale_dtype)
    mins = (torch.randn(out_f, groups, device=device) * 0.01).to(torch.float16) if fmt == "int4_asym" else None
    return QuantizedWeight(fmt, q.contiguous(), scales, mins, group, (out_f, in_f))
