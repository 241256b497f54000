"""Triton: the gated delta rule over a prompt (prefill of one sequence), a chunk of C = 64 tokens at a time.

Twin: `kernels.reference.gdn_chunked_ref`. Per-token math, normalisation and head grouping as in
`kernels.gated_delta`; layouts without the batch dim: q, k [T, HK, Dk], v [T, HV, Dv], g, beta [T, HV], state
[S, HV, Dk, Dv] float32/float16 (state[slot] read and written), o [T, HV, Dv] float32.

Inside a chunk, with G_i = g_1 + ... + g_i and A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, the token
corrections are delta = u - w S_0 with u = (I + A)^-1 (beta v), w = (I + A)^-1 (beta exp(G) k); then
    o_i = exp(G_i) S_0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) delta_j
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j delta_j^T
Two kernels:
  `_chunk_prepare_kernel`, program (chunk, value head), all chunks in parallel: A from k k^T (accumulated over Dk
      blocks, normalised afterwards with the row norms), (I + A)^-1 by forward substitution over the C rows (a unit
      lower-triangular matrix: no pivoting, exact up to rounding), then u and w (float32 scratch [T, HV, D]).
  `_chunk_scan_kernel`, program (value head, block of BLOCK_V value columns): walks the chunks in order carrying its
      [Dk, BLOCK_V] slice of the state in float32 registers: delta, the outputs and the next state are five tl.dots
      per chunk. The slot is read once and stored once (rounded to the pool's dtype).
Tokens past T in the last chunk load as k = v = 0, g = beta = 0: they change nothing and are not stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted
from kernels.gated_delta import NORM_EPS

CHUNK = 64


@triton.jit
def _chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, T, DK, DV, GROUP, eps,
                          stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_wt, stride_wh,
                          stride_ut, stride_uh, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                          PRECISION: tl.constexpr):
    hv = tl.program_id(1).to(tl.int64)
    hk = hv // GROUP
    rows = tl.arange(0, C)
    offs_t = tl.program_id(0).to(tl.int64) * C + rows
    mt = offs_t < T
    g = tl.load(g_ptr + offs_t * stride_gt + hv, mask=mt, other=0).to(tl.float32)
    beta = tl.load(beta_ptr + offs_t * stride_bt + hv, mask=mt, other=0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)

    kk = tl.zeros([C, C], dtype=tl.float32)
    sq = tl.zeros([C], dtype=tl.float32)
    for d0 in range(0, DK, BLOCK_K):
        offs_d = d0 + tl.arange(0, BLOCK_K)
        kb = tl.load(k_ptr + offs_t[:, None] * stride_kt + hk * stride_kh + offs_d[None, :],
                     mask=mt[:, None] & (offs_d < DK)[None, :], other=0).to(tl.float32)
        kk += tl.dot(kb, tl.trans(kb), input_precision=PRECISION)
        sq += tl.sum(kb * kb, axis=1)
    rk = tl.rsqrt(sq + eps)
    below = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(below, cum[:, None] - cum[None, :], float("-inf")))
    a = tl.where(below, (beta * rk)[:, None] * rk[None, :] * kk * decay, 0.0)

    # (I + A)^-1: row r = e_r - sum_{j < r} A[r, j] * row j (rows above r are final when row r is formed)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for r in range(1, C):
        a_r = tl.sum(tl.where(rows[:, None] == r, a, 0.0), axis=0)
        inv = tl.where(rows[:, None] == r, inv - tl.sum(a_r[:, None] * inv, axis=0)[None, :], inv)

    k_scale = beta * tl.exp(cum) * rk
    for d0 in range(0, DK, BLOCK_K):
        offs_d = d0 + tl.arange(0, BLOCK_K)
        md = mt[:, None] & (offs_d < DK)[None, :]
        kb = tl.load(k_ptr + offs_t[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=md,
                     other=0).to(tl.float32)
        w = tl.dot(inv, kb * k_scale[:, None], input_precision=PRECISION)
        tl.store(w_ptr + offs_t[:, None] * stride_wt + hv * stride_wh + offs_d[None, :], w, mask=md)
    for e0 in range(0, DV, BLOCK_V):
        offs_e = e0 + tl.arange(0, BLOCK_V)
        me = mt[:, None] & (offs_e < DV)[None, :]
        vb = tl.load(v_ptr + offs_t[:, None] * stride_vt + hv * stride_vh + offs_e[None, :], mask=me,
                     other=0).to(tl.float32)
        u = tl.dot(inv, vb * beta[:, None], input_precision=PRECISION)
        tl.store(u_ptr + offs_t[:, None] * stride_ut + hv * stride_uh + offs_e[None, :], u, mask=me)


@triton.jit
def _chunk_scan_kernel(q_ptr, k_ptr, g_ptr, w_ptr, u_ptr, state_ptr, o_ptr, T, DK, DV, GROUP, q_scale, eps,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_wt, stride_wh, stride_ut,
                       stride_uh, stride_sh, stride_sk, stride_ot, stride_oh,
                       C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    hv = tl.program_id(0).to(tl.int64)
    hk = hv // GROUP
    rows = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    tile = hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s = tl.load(state_ptr + tile, mask=mk[:, None] & mv[None, :], other=0).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    for c in range(0, tl.cdiv(T, C)):
        offs_t = c * C + rows
        mt = offs_t < T
        mtk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        cum = tl.cumsum(tl.load(g_ptr + offs_t * stride_gt + hv, mask=mt, other=0).to(tl.float32), axis=0)
        last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)
        q = tl.load(q_ptr + offs_t[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=mtk,
                    other=0).to(tl.float32)
        k = tl.load(k_ptr + offs_t[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=mtk,
                    other=0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + eps) * q_scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
        w = tl.load(w_ptr + offs_t[:, None] * stride_wt + hv * stride_wh + offs_k[None, :], mask=mtk, other=0)
        u = tl.load(u_ptr + offs_t[:, None] * stride_ut + hv * stride_uh + offs_v[None, :], mask=mtv, other=0)
        delta = u - tl.dot(w, s, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = scores * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PRECISION)
        o += tl.dot(scores, delta, input_precision=PRECISION)
        tl.store(o_ptr + offs_t[:, None] * stride_ot + hv * stride_oh + offs_v[None, :], o, mask=mtv)
        k_to_end = k * tl.exp(last - cum)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_to_end), delta, input_precision=PRECISION)
    tl.store(state_ptr + tile, s.to(state_ptr.dtype.element_ty), mask=mk[:, None] & mv[None, :])


def chunk_launch_params(dk: int, dv: int) -> dict:
    """Blocks and warps on a GPU (checked spill-free for sm_80/sm_90 at Dk = Dv = 128 by
    tests/kernels/test_cuda_compile.py): prepare walks Dk and Dv in 64-wide blocks with 4 warps; the scan keeps a
    [Dk, 32] state slice and [64, Dk] q/k/w tiles with 8 warps."""
    block_k = max(16, triton.next_power_of_2(dk))
    return {"prepare_k": min(64, block_k), "prepare_v": min(64, max(16, triton.next_power_of_2(dv))),
            "prepare_warps": 4, "scan_k": block_k, "scan_v": min(32, max(16, triton.next_power_of_2(dv))),
            "scan_warps": 8}


GPU_PRECISION = "tf32x3"  # about float32 accuracy on tensor cores


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, slot: int) -> torch.Tensor:
    """See the module docstring. Updates state[slot] in place; returns o [T, HV, Dv] float32."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3 or x.stride(-1) != 1:
            raise ValueError(f"{name} must be 3-D and contiguous in its last dim, got {list(x.shape)}")
    T, HK, DK = q.shape
    HV, DV = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or HV % HK:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: need equal q/k and HV % HK == 0")
    if state.dim() != 4 or state.shape[1:] != (HV, DK, DV) or state.stride(-1) != 1:
        raise ValueError(f"state {list(state.shape)} is not a [slots, {HV}, {DK}, {DV}] pool contiguous in Dv")
    if g.shape != (T, HV) or beta.shape != (T, HV):
        raise ValueError(f"g {list(g.shape)} / beta {list(beta.shape)} must be [{T}, {HV}]")
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    o = torch.empty(T, HV, DV, dtype=torch.float32, device=q.device)
    if T == 0:
        return o
    slot = int(slot)
    p = chunk_launch_params(DK, DV)
    interpreted = is_interpreted(_chunk_scan_kernel)
    if interpreted:  # whole heads per program, IEEE float32 dots
        whole_v = max(16, triton.next_power_of_2(DV))
        p.update(prepare_k=p["scan_k"], prepare_v=whole_v, scan_v=whole_v)
    prec = "ieee" if interpreted else GPU_PRECISION
    w = torch.empty(T, HV, DK, dtype=torch.float32, device=q.device)
    u = torch.empty(T, HV, DV, dtype=torch.float32, device=q.device)
    _chunk_prepare_kernel[(triton.cdiv(T, CHUNK), HV)](
        k, v, g, beta, w, u, T, DK, DV, HV // HK, NORM_EPS, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        C=CHUNK, BLOCK_K=p["prepare_k"], BLOCK_V=p["prepare_v"], PRECISION=prec, num_warps=p["prepare_warps"])
    _chunk_scan_kernel[(HV, triton.cdiv(DV, p["scan_v"]))](
        q, k, g, w, u, state[slot], o, T, DK, DV, HV // HK, DK ** -0.5, NORM_EPS, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), g.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        state.stride(1), state.stride(2), o.stride(0), o.stride(1),
        C=CHUNK, BLOCK_K=p["scan_k"], BLOCK_V=p["scan_v"], PRECISION=prec, num_warps=p["scan_warps"])
    return o
