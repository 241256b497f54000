"""Pick the Triton kernel or its PyTorch twin (or an ATen CPU fast path) for each operation.

`use_triton(device)` is True when triton is importable, NINFER_NO_TRITON is unset/empty/"0", and either the device is
CUDA or TRITON_INTERPRET=1 (tests run the kernels on the CPU through the interpreter). The Triton modules are
imported lazily (inside the functions), so this module works where triton is not installed.

Public functions (same signatures as the twins in kernels/reference.py):
  linear(x, qw, bias=None, *, cpu_compute_dtype=CPU_COMPUTE_DTYPE)
  dequantize_to(qw, dtype)
  rms_norm(x, weight, eps, residual=None)
  rope(x, positions, cos, sin)
  silu_and_mul(x)
  paged_decode_attention(q, k_cache, v_cache, page_table, ctx_lens, scale=None, k_scale=None, v_scale=None)
  gdn_recurrent(q, k, v, g, beta, state, slots, step_slots=None)
  gdn_chunked(q, k, v, g, beta, state, slot)
  causal_conv_update(x, weight, conv_state, slots)
  fused_moe(x, w_gate_up, w_down, weights, ids)
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from kernels import cpu, reference
from kernels.quant import QuantizedWeight, dequantize

# The CPU low-bit ops of ATen are fast with bf16 activations and 7-160x slower with float32 ones (docs/KERNELS.md),
# so float32 activations are rounded to bf16 for them and the result cast back. None = run in x.dtype.
CPU_COMPUTE_DTYPE: Optional[torch.dtype] = torch.bfloat16


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def use_triton(device: torch.device | str) -> bool:
    # called a few hundred times per decode step: the CPU case reads one variable (the environment is read on every
    # call, not cached, so tests and users may set it at any time)
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return os.environ.get("NINFER_NO_TRITON", "") in ("", "0") and triton_available()


# ---------------------------------------------------------------------------------------------------- linear
def cpu_linear_path(qw: QuantizedWeight, x_dtype: torch.dtype = torch.float32,
                    compute_dtype: Optional[torch.dtype] = CPU_COMPUTE_DTYPE) -> str:
    """Which CPU path `linear` takes: 'int8pack', 'int4pack', 'int8split' (grouped int8 as two int4 planes),
    'dense' (dequantized once into the compute dtype, for the rest) or 'dequant' (dequantize + F.linear on every
    call). The ATen low-bit kernels only win with bf16 activations (their float32 and float16 kernels lose to
    dequant: docs/KERNELS.md)."""
    if (compute_dtype or x_dtype) == torch.bfloat16:
        if cpu.int8pack_supported(qw):
            return "int8pack"
        if cpu.int4pack_supported(qw):
            return "int4pack"
        if cpu.int8split_supported(qw):
            return "int8split"
        return "dense"
    return "dequant"


def _cpu_linear_fn(qw: QuantizedWeight, x_dtype: torch.dtype, compute_dtype: Optional[torch.dtype]):
    path = cpu_linear_path(qw, x_dtype, compute_dtype)
    fn = {"int8pack": cpu.int8pack_fn, "int4pack": cpu.int4pack_fn, "int8split": cpu.int8split_fn,
          "dense": cpu.dense_fn}.get(path)
    run = functools.partial(cpu.dequant_linear, qw=qw) if fn is None else fn(qw, compute_dtype or x_dtype)
    if qw.cache.get("lowbit_native") and x_dtype == torch.float32:
        return cpu.native_fn(qw, many=run)  # decode rows through the C++ kernel, prompts as above
    return run


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None, *,
           cpu_compute_dtype: Optional[torch.dtype] = CPU_COMPUTE_DTYPE) -> torch.Tensor:
    """y = x @ dequantize(qw).T (+ bias), y in x.dtype. Twin: reference.quant_linear_ref."""
    if use_triton(x.device):
        from kernels import qlinear
        return qlinear.qlinear(x, qw, bias)
    if x.device.type == "cpu":
        key = ("cpu_linear", x.dtype, cpu_compute_dtype)
        run = qw.cache.get(key)
        if run is None:  # decided once per weight and activation dtype, then a direct call (decode is op-bound)
            run = qw.cache[key] = _cpu_linear_fn(qw, x.dtype, cpu_compute_dtype)
        y = run(x)
        return y if bias is None else y + bias.to(y.dtype)
    return F.linear(x, dequantize(qw, x.dtype), bias)


def dequantize_to(qw: QuantizedWeight, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Dense [out, in] weight in `dtype`. Twin: kernels.quant.dequantize."""
    if use_triton(qw.device):
        from kernels import qlinear
        return qlinear.dequantize_to(qw, dtype)
    return dequantize(qw, dtype)


# ---------------------------------------------------------------------------------------------------- the rest
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    if use_triton(x.device):
        from kernels.rms_norm import rms_norm as kernel
        return kernel(x, weight, eps, residual)
    return reference.rms_norm_ref(x, weight, eps, residual)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if use_triton(x.device):
        from kernels.rope import rope as kernel
        return kernel(x, positions, cos, sin)
    return reference.rope_ref(x, positions, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x.device):
        from kernels.silu_and_mul import silu_and_mul as kernel
        return kernel(x)
    return reference.silu_and_mul_ref(x)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: Optional[float] = None,
                           k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention over float or quantized pages (k_scale/v_scale given: int8 or packed int4 codes, one layer
    of the KVCache; rk* queries come rotated). Twin: reference.paged_decode_attention_ref."""
    if use_triton(q.device):
        from kernels.paged_attention import paged_decode_attention as kernel
        return kernel(q, k_cache, v_cache, page_table, ctx_lens, scale, k_scale=k_scale, v_scale=v_scale)
    return reference.paged_decode_attention_ref(q, k_cache, v_cache, page_table, ctx_lens, scale, k_scale=k_scale,
                                                v_scale=v_scale)


def kv_quant_write(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int,
                   group: int) -> bool:
    """Quantizes and writes KV rows with the Triton kernel where it runs (True); False leaves it to the caller's
    PyTorch path (engine/memory/kv/quant.py, the twin)."""
    if not use_triton(x.device):
        return False
    from kernels import kv_write
    if not kv_write.supported(x.shape[-1], group):
        return False
    kv_write.kv_quant_write(x, slots, codes, scales, bits, group)
    return True


def quest_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    if use_triton(q.device):
        from kernels.quest import quest_bounds as kernel
        return kernel(q, kmin, kmax)
    return reference.quest_bounds_ref(q, kmin, kmax)


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, slots: torch.Tensor, step_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gated delta rule for B sequences of T tokens over state-pool slots (in place); o [B, T, HV, Dv] float32.
    Twin: reference.gdn_recurrent_ref."""
    if use_triton(q.device):
        from kernels.gated_delta import gdn_recurrent as kernel
        return kernel(q, k, v, g, beta, state, slots, step_slots)
    return reference.gdn_recurrent_ref(q, k, v, g, beta, state, slots, step_slots)


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, slot: int) -> torch.Tensor:
    """The gated delta rule over one sequence's T prompt tokens from state[slot] (in place); o [T, HV, Dv] float32.
    Twin: reference.gdn_chunked_ref."""
    if use_triton(q.device):
        from kernels.gated_delta_chunk import gdn_chunked as kernel
        return kernel(q, k, v, g, beta, state, slot)
    return reference.gdn_chunked_ref(q, k, v, g, beta, state, slot)


def causal_conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
    """One decode token's depthwise causal conv + SiLU over conv-state slots (in place); [B, C] float32.
    Twin: reference.causal_conv_update_ref."""
    if use_triton(x.device):
        from kernels.gated_delta import causal_conv_update as kernel
        return kernel(x, weight, conv_state, slots)
    return reference.causal_conv_update_ref(x, weight, conv_state, slots)


def fused_moe(x: torch.Tensor, w_gate_up, w_down, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A MoE MLP's routed experts over stacked expert weights (dense [E, N, K] or QuantizedWeight [E * N, K]);
    [T, H] in x.dtype. Twin: reference.fused_moe_ref."""
    if use_triton(x.device):
        from kernels.moe import fused_moe as kernel
        return kernel(x, w_gate_up, w_down, weights, ids)
    return reference.fused_moe_ref(x, w_gate_up, w_down, weights, ids)
