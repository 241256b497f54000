"""Which number formats a model runs in: activations, linear weights and the KV cache, from the settings."""
from __future__ import annotations

import torch

from engine.memory.kv.quant import QUANT_KV_DTYPES
from engine.memory.dtypes import auto_float, float_format
from engine.memory.geometry import resolve_kv_dtype
from engine.model.linear import LOW_BIT, native_format



def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    fmt = auto_float(device.type == "cuda") if name == "auto" else float_format(name)
    return getattr(torch, fmt.torch_name)


def weight_format(name: str, weights) -> str:
    """The low-bit format of the linear weights ("" = dense): auto keeps what a GGUF file stores (Q4_0/Q4_1 -> int4,
    Q8_0 -> int8, TQ2_0 -> ternary) and runs other files dense."""
    if name == "auto":
        return native_format(weights.tensors) or ""
    return name if name in LOW_BIT else ""


def pick_kv_dtype(name: str, device: torch.device) -> torch.dtype | str:
    """The KV cache's format: auto = fp32 on the CPU, bf16 on CUDA (as the weights); a float name as its torch
    dtype; the quantized formats (k8v8, k8v4, k4v4, rk4v4) only when asked for, as their name."""
    name = resolve_kv_dtype(name, on_gpu=device.type == "cuda")
    return name if name in QUANT_KV_DTYPES else pick_dtype(name, device)
