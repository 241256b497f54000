"""Triton: the gated delta rule at decode (the Gated-DeltaNet layers of Qwen3.5 / Qwen3-Next hybrids), batched over
sequences whose states live in slots of a state pool, and the depthwise causal convolution that feeds it.

Twins: `kernels.reference.gdn_recurrent_ref`, `kernels.reference.causal_conv_update_ref`. The prompt (chunked) form
is in `kernels.gated_delta_chunk`.

Per token, for value head h (served by key head h // (HV / HK)) with state S [Dk, Dv]:
    q <- q * rsqrt(|q|^2 + 1e-6) * Dk^-0.5;   k <- k * rsqrt(|k|^2 + 1e-6)
    S <- exp(g) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q

`gdn_recurrent` layouts: q, k [B, T, HK, Dk] (raw, any float dtype, contiguous in Dk), v [B, T, HV, Dv], g, beta
[B, T, HV] float32, state [S, HV, Dk, Dv] float32 or float16 (contiguous in Dv), slots int [B]; o [B, T, HV, Dv]
float32. Program (sequence, value head, block of BLOCK_V value columns) keeps its [Dk, BLOCK_V] slice of the state in
float32 registers over the T tokens, reads the slot once and stores it once. With step_slots [B, T] the state after
token t is also stored in slot step_slots[b, t] (-1: not stored), for speculative decoding to roll back to.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted

NORM_EPS = 1e-6


@triton.jit
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, step_ptr, o_ptr, T, DK, DV,
                          GROUP, q_scale, eps, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh, stride_gb, stride_gt, stride_bb, stride_bt,
                          stride_ss, stride_sh, stride_sk, stride_stb, stride_ob, stride_ot, stride_oh,
                          HAS_STEPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    m2 = mk[:, None] & mv[None, :]
    hk = hv // GROUP
    tile = hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s = tl.load(state_ptr + slot * stride_ss + tile, mask=m2, other=0).to(tl.float32)
    for t in range(T):
        q = tl.load(q_ptr + b * stride_qb + t * stride_qt + hk * stride_qh + offs_k, mask=mk, other=0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + t * stride_kt + hk * stride_kh + offs_k, mask=mk, other=0).to(tl.float32)
        v = tl.load(v_ptr + b * stride_vb + t * stride_vt + hv * stride_vh + offs_v, mask=mv, other=0).to(tl.float32)
        g = tl.load(g_ptr + b * stride_gb + t * stride_gt + hv).to(tl.float32)
        beta = tl.load(beta_ptr + b * stride_bb + t * stride_bt + hv).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + eps) * q_scale)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + b * stride_ob + t * stride_ot + hv * stride_oh + offs_v, o, mask=mv)
        if HAS_STEPS:
            dst = tl.load(step_ptr + b * stride_stb + t).to(tl.int64)
            tl.store(state_ptr + tl.maximum(dst, 0) * stride_ss + tile, s.to(state_ptr.dtype.element_ty),
                     mask=m2 & (dst >= 0))
    tl.store(state_ptr + slot * stride_ss + tile, s.to(state_ptr.dtype.element_ty), mask=m2)


def recurrent_launch_params(dk: int, dv: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps) on a GPU: a [128, 16] float32 state slice (64-80 registers a thread at 4 warps
    for sm_80/sm_90, tests/kernels/test_cuda_compile.py), and B x HV x Dv/16 programs (384 for one sequence of
    Qwen3.5's 48 heads) to spread a single sequence over the SMs."""
    block_k = max(16, triton.next_power_of_2(dk))
    return block_k, 16, 4 if block_k <= 128 else 8


def _check_float_rows(name: str, x: torch.Tensor, ndim: int):
    if x.dim() != ndim or x.stride(-1) != 1:
        raise ValueError(f"{name} must be {ndim}-D and contiguous in its last dim, got {list(x.shape)}")


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, slots: torch.Tensor, step_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See the module docstring. Updates `state` in place; returns o [B, T, HV, Dv] float32."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float_rows(name, x, 4)
    B, T, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, T) or HV % HK:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: need equal q/k and HV % HK == 0")
    if state.dim() != 4 or state.shape[1:] != (HV, DK, DV) or state.stride(-1) != 1:
        raise ValueError(f"state {list(state.shape)} is not a [slots, {HV}, {DK}, {DV}] pool contiguous in Dv")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g {list(g.shape)} / beta {list(beta.shape)} must be [{B}, {T}, {HV}]")
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    slots = slots.to(device=q.device, dtype=torch.int64).contiguous()
    if step_slots is not None:
        if step_slots.shape != (B, T):
            raise ValueError(f"step_slots {list(step_slots.shape)} must be [{B}, {T}]")
        step_slots = step_slots.to(device=q.device, dtype=torch.int64).contiguous()
    steps = step_slots if step_slots is not None else slots
    o = torch.empty(B, T, HV, DV, dtype=torch.float32, device=q.device)
    if B == 0 or T == 0:
        return o
    block_k, block_v, warps = recurrent_launch_params(DK, DV)
    _gdn_recurrent_kernel[(B, HV, triton.cdiv(DV, block_v))](
        q, k, v, g, beta, state, slots, steps, o, T, DK, DV, HV // HK, DK ** -0.5, NORM_EPS,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), steps.stride(0), o.stride(0), o.stride(1), o.stride(2),
        HAS_STEPS=step_slots is not None, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=warps)
    return o


@triton.jit
def _causal_conv_update_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, o_ptr, C, stride_xb, stride_wc, stride_ss,
                               stride_sc, stride_sk, stride_ob, K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    col = state_ptr + slot * stride_ss + offs_c * stride_sc  # column j of the window: col + j * stride_sk
    x = tl.load(x_ptr + b * stride_xb + offs_c, mask=mc, other=0).to(tl.float32)
    acc = x * tl.load(w_ptr + offs_c * stride_wc + (K - 1), mask=mc, other=0).to(tl.float32)
    prev = tl.load(col, mask=mc, other=0)
    acc += prev.to(tl.float32) * tl.load(w_ptr + offs_c * stride_wc, mask=mc, other=0).to(tl.float32)
    for j in tl.static_range(1, K - 1):  # shift the window left by one as it is read
        cur = tl.load(col + j * stride_sk, mask=mc, other=0)
        acc += cur.to(tl.float32) * tl.load(w_ptr + offs_c * stride_wc + j, mask=mc, other=0).to(tl.float32)
        tl.store(col + (j - 1) * stride_sk, cur, mask=mc)
    tl.store(col + (K - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=mc)
    tl.store(o_ptr + b * stride_ob + offs_c, acc * tl.sigmoid(acc), mask=mc)


def causal_conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU for one decode token of B sequences over conv-state slots (twin:
    `causal_conv_update_ref`): x [B, C], weight [C, K], conv_state [S, C, K - 1] (oldest first), slots int [B];
    shifts each slot's window by x in place; returns [B, C] float32. Program (sequence, 256 channels)."""
    B, C = x.shape
    K = weight.shape[1]
    if weight.shape != (C, K) or K < 2 or conv_state.dim() != 3 or conv_state.shape[1:] != (C, K - 1):
        raise ValueError(f"x {list(x.shape)}, weight {list(weight.shape)}, conv_state {list(conv_state.shape)}: need "
                         f"[B, C], [C, K >= 2], [S, C, K - 1]")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    slots = slots.to(device=x.device, dtype=torch.int64).contiguous()
    out = torch.empty(B, C, dtype=torch.float32, device=x.device)
    if B == 0:
        return out
    block_c = 4096 if is_interpreted(_causal_conv_update_kernel) else 256
    _causal_conv_update_kernel[(B, triton.cdiv(C, block_c))](
        x, weight, conv_state, slots, out, C, x.stride(0), weight.stride(0), *conv_state.stride(), out.stride(0),
        K=K, BLOCK_C=block_c, num_warps=2)
    return out
