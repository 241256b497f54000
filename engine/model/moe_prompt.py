"""A prompt's routed experts on the CPU in one C++ call (kernels/cpu_moe_prompt.cpp), where it computes exactly what
MoEMLP._grouped's Python loop computes: every expert's two Linear layers hold low-bit weights that the C++ kernel
reads for a few rows (engine/model/linear.use_cpu_kernel marked them) and that run the dense prompt path from the
same row count on (one DenseScratch, engine/model/linear.enable_dense_prefill). The loop pays a dozen ATen calls per
expert, each a fork and join of the threads (one prompt of the 64-expert, 16-layer test model: ~12,000); the C++
call gives whole experts to the threads in turn."""
from __future__ import annotations

import torch

from engine.model.linear import Linear, dense_cpu_dtype
from kernels import cpu_native
from kernels.quant import QuantizedWeight


def _operands(linears: list[Linear]) -> tuple | None:
    """(codes, scales, mins, symmetric) lists of the linears' weights, or None where one is not the kind the kernel
    takes as Linear would run it (low-bit, marked for the C++ kernel, no bias, the dense prompt path on)."""
    ws = [lin.weight for lin in linears]
    if not all(isinstance(w, QuantizedWeight) and w.cache.get("lowbit_native") and cpu_native.lowbit_supported(w)
               for w in ws) or any(lin.bias is not None or lin.scratch is None for lin in linears):
        return None
    sym = {w.format == "int4_sym" for w in ws}
    if len(sym) != 1:
        return None
    return [w.qweight for w in ws], [w.scales for w in ws], [w.mins for w in ws], sym.pop()


def prompt_operands(experts: list) -> tuple | None:
    """What `routed_prompt` passes the kernel for these experts (engine/model/moe.Expert), with the row count up to
    which their Linears take the low-bit kernel; None where the kernel does not compute what they do."""
    if not cpu_native.loaded() or not experts:
        return None
    gate_up, down = _operands([x.gate_up for x in experts]), _operands([x.down for x in experts])
    if gate_up is None or down is None:
        return None
    scratches = {id(lin.scratch) for x in experts for lin in (x.gate_up, x.down)}
    if len(scratches) != 1:
        return None
    return gate_up, down, experts[0].gate_up.scratch.min_rows - 1


def routed_prompt(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, operands: tuple) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(h[t]) for float32 CPU rows h [T, H], as MoEMLP._grouped sums it."""
    gate_up, down, few = operands
    bf16 = dense_cpu_dtype() == torch.bfloat16
    return cpu_native.moe_prompt_op()(h, ids, weights.float(), *gate_up, *down, few, bf16)
