"""Triton: the gated delta rule over a prompt (prefill of one sequence), a chunk of C = 64 tokens at a time.

Twin: `kernels.reference.gdn_chunked_ref`. Per-token math, normalisation and head grouping as in
`kernels.gated_delta`; layouts without the batch dim: q, k [T, HK, Dk], v [T, HV, Dv], g, beta [T, HV], state
[S, HV, Dk, Dv] float32/float16 (state[slot] read and written), o [T, HV, Dv] float32.

Inside a chunk, with G_i = g_1 + ... + g_i and A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, the token
corrections are delta = u - w S_0 with u = (I + A)^-1 (beta v), w = (I + A)^-1 (beta exp(G) k); then
    o_i = exp(G_i) S_0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) delta_j
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j delta_j^T
(q, k normalised.) Three kernels:
  `_chunk_prepare_kernel`, program (chunk, value head), all chunks in parallel: k k^T and q k^T accumulated over
      Dk blocks of the raw rows, normalised afterwards by the row norms; (I + A)^-1 by forward substitution over the
      C rows (unit lower-triangular: no pivoting); then u, w, the masked decayed scores exp(G_i - G_j) (q_i . k_j)
      (j <= i) and the row scales rq = Dk^-0.5 / |q|, rk = 1 / |k|, into float32 scratch ([T, HV, Dk | Dv | C]).
  `_chunk_state_kernel`, program (value head, BLOCK_V value columns), the only sequential pass: walks the chunks
      carrying its slice of the state in float32 registers (one [BLOCK_K, BLOCK_V] tile, or two for Dk = 2 BLOCK_K:
      a dot operand lives in registers whole, so smaller tiles keep them from spilling); per chunk it stores the
      state entering the chunk (h), delta = u - w S (over u), and S <- exp(G_C) S + k^T (rk exp(G_C - G) delta).
  `_chunk_output_kernel`, program (chunk, value head, BLOCK_V value columns), all chunks in parallel:
      o = rq exp(G) (q h) + scores delta.
Row scales are applied to the small side of each product (delta, the result, the inverse's columns) so the raw
q/k/v tiles feed the dots as loaded. A prompt is processed in segments of SEGMENT_CHUNKS chunks, bounding h; the
state between segments stays float32, so the slot is read once and stored once (rounded to the pool's dtype).
Tokens past T in the last chunk load as q = k = v = 0, g = beta = 0: they change nothing and are not stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted
from kernels.gated_delta import NORM_EPS

CHUNK = 64


@triton.jit
def _rows(ptr, t0, rows, mt, stride_t, head_off, d0, D, BLOCK: tl.constexpr):
    """[C, BLOCK] float32: columns d0 .. d0 + BLOCK of one head's rows t0 + rows (zeros past T and past D). The
    64-bit part of the address is one scalar; the tile's offsets stay 32-bit (fewer registers)."""
    offs = d0 + tl.arange(0, BLOCK)
    base = ptr + t0.to(tl.int64) * stride_t + head_off
    return tl.load(base + rows[:, None] * stride_t + offs[None, :], mask=mt[:, None] & (offs < D)[None, :],
                   other=0).to(tl.float32)


@triton.jit
def _store_rows(ptr, x, t0, rows, mt, stride_t, head_off, d0, D, BLOCK: tl.constexpr):
    offs = d0 + tl.arange(0, BLOCK)
    base = ptr + t0.to(tl.int64) * stride_t + head_off
    tl.store(base + rows[:, None] * stride_t + offs[None, :], x, mask=mt[:, None] & (offs < D)[None, :])


@triton.jit
def _chunk_prepare_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, a_ptr, rq_ptr, rk_ptr, T, DK, DV,
                          GROUP, q_scale, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_gt, stride_bt, stride_wt, stride_wh, stride_ut, stride_uh, stride_at, stride_ah,
                          stride_rt, C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                          PRECISION: tl.constexpr):
    hv = tl.program_id(1).to(tl.int64)
    hk = hv // GROUP
    rows = tl.arange(0, C)
    t0 = tl.program_id(0) * C
    offs_t = t0.to(tl.int64) + rows
    mt = offs_t < T
    g = tl.load(g_ptr + offs_t * stride_gt + hv, mask=mt, other=0).to(tl.float32)
    beta = tl.load(beta_ptr + offs_t * stride_bt + hv, mask=mt, other=0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)

    kk = tl.zeros([C, C], dtype=tl.float32)
    qk = tl.zeros([C, C], dtype=tl.float32)
    sq_k = tl.zeros([C], dtype=tl.float32)
    sq_q = tl.zeros([C], dtype=tl.float32)
    for d0 in range(0, DK, BLOCK_K):
        kb = _rows(k_ptr, t0, rows, mt, stride_kt, hk * stride_kh, d0, DK, BLOCK_K)
        qb = _rows(q_ptr, t0, rows, mt, stride_qt, hk * stride_qh, d0, DK, BLOCK_K)
        kk = tl.dot(kb, tl.trans(kb), kk, input_precision=PRECISION)
        qk = tl.dot(qb, tl.trans(kb), qk, input_precision=PRECISION)
        sq_k += tl.sum(kb * kb, axis=1)
        sq_q += tl.sum(qb * qb, axis=1)
    rk = tl.rsqrt(sq_k + eps)
    rq = tl.rsqrt(sq_q + eps) * q_scale
    tl.store(rk_ptr + offs_t * stride_rt + hv, rk, mask=mt)
    tl.store(rq_ptr + offs_t * stride_rt + hv, rq, mask=mt)
    causal = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
    _store_rows(a_ptr, qk * rq[:, None] * rk[None, :] * decay, t0, rows, mt, stride_at, hv * stride_ah, 0, C, C)
    a = tl.where(rows[:, None] > rows[None, :], (beta * rk)[:, None] * rk[None, :] * kk * decay, 0.0)

    # (I + A)^-1: row r = e_r - sum_{j < r} A[r, j] * row j (rows above r are final when row r is formed)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for r in range(1, C):
        a_r = tl.sum(tl.where(rows[:, None] == r, a, 0.0), axis=0)
        inv = tl.where(rows[:, None] == r, inv - tl.sum(a_r[:, None] * inv, axis=0)[None, :], inv)

    # row scales of the right-hand sides go into the columns of the inverse (raw tiles feed the dots directly)
    inv_k = inv * (beta * tl.exp(cum) * rk)[None, :]
    for d0 in range(0, DK, BLOCK_K):
        kb = _rows(k_ptr, t0, rows, mt, stride_kt, hk * stride_kh, d0, DK, BLOCK_K)
        w = tl.dot(inv_k, kb, input_precision=PRECISION)
        _store_rows(w_ptr, w, t0, rows, mt, stride_wt, hv * stride_wh, d0, DK, BLOCK_K)
    inv_v = inv * beta[None, :]
    for e0 in range(0, DV, BLOCK_V):
        vb = _rows(v_ptr, t0, rows, mt, stride_vt, hv * stride_vh, e0, DV, BLOCK_V)
        u = tl.dot(inv_v, vb, input_precision=PRECISION)
        _store_rows(u_ptr, u, t0, rows, mt, stride_ut, hv * stride_uh, e0, DV, BLOCK_V)


@triton.jit
def _chunk_state_kernel(k_ptr, g_ptr, w_ptr, u_ptr, rk_ptr, h_ptr, src_ptr, dst_ptr, c_begin, c_end, T, DK, DV, GROUP,
                        stride_kt, stride_kh, stride_gt, stride_wt, stride_wh, stride_ut, stride_uh, stride_rt,
                        stride_hc, stride_hh, stride_sh, stride_sk, C: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_V: tl.constexpr, TWO_HALVES: tl.constexpr, PRECISION: tl.constexpr):
    hv = tl.program_id(0).to(tl.int64)
    hk = hv // GROUP
    rows = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    v0 = tl.program_id(1) * BLOCK_V
    offs_v = v0 + tl.arange(0, BLOCK_V)
    mv = offs_v < DV
    tile0 = offs_k[:, None] * stride_sk + offs_v[None, :]
    tile1 = tile0 + BLOCK_K * stride_sk
    m0 = (offs_k < DK)[:, None] & mv[None, :]
    m1 = (BLOCK_K + offs_k < DK)[:, None] & mv[None, :]
    h_tile0 = offs_k[:, None] * DV + offs_v[None, :]  # h is [chunks, HV, Dk, Dv] contiguous
    h_tile1 = h_tile0 + BLOCK_K * DV
    s0 = tl.load(src_ptr + hv * stride_sh + tile0, mask=m0, other=0).to(tl.float32)
    if TWO_HALVES:
        s1 = tl.load(src_ptr + hv * stride_sh + tile1, mask=m1, other=0).to(tl.float32)
    else:
        s1 = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for c in range(c_begin, c_end):
        t0 = c * C
        offs_t = t0.to(tl.int64) + rows
        mt = offs_t < T
        h = h_ptr + (c - c_begin).to(tl.int64) * stride_hc + hv * stride_hh
        tl.store(h + h_tile0, s0, mask=m0)  # the state entering the chunk, for the output kernel
        w_s = tl.dot(_rows(w_ptr, t0, rows, mt, stride_wt, hv * stride_wh, 0, DK, BLOCK_K), s0,
                     input_precision=PRECISION)
        if TWO_HALVES:
            tl.store(h + h_tile1, s1, mask=m1)
            w_s = tl.dot(_rows(w_ptr, t0, rows, mt, stride_wt, hv * stride_wh, BLOCK_K, DK, BLOCK_K), s1, w_s,
                         input_precision=PRECISION)
        delta = _rows(u_ptr, t0, rows, mt, stride_ut, hv * stride_uh, v0, DV, BLOCK_V) - w_s
        _store_rows(u_ptr, delta, t0, rows, mt, stride_ut, hv * stride_uh, v0, DV, BLOCK_V)  # u becomes delta

        cum = tl.cumsum(tl.load(g_ptr + offs_t * stride_gt + hv, mask=mt, other=0).to(tl.float32), axis=0)
        last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)
        # (rk exp(G_C - G) k)^T delta, with the row scales on delta (the raw k tile feeds the dot directly)
        delta = delta * (tl.load(rk_ptr + offs_t * stride_rt + hv, mask=mt, other=0) * tl.exp(last - cum))[:, None]
        k0 = _rows(k_ptr, t0, rows, mt, stride_kt, hk * stride_kh, 0, DK, BLOCK_K)
        s0 = tl.dot(tl.trans(k0), delta, s0 * tl.exp(last), input_precision=PRECISION)
        if TWO_HALVES:
            k1 = _rows(k_ptr, t0, rows, mt, stride_kt, hk * stride_kh, BLOCK_K, DK, BLOCK_K)
            s1 = tl.dot(tl.trans(k1), delta, s1 * tl.exp(last), input_precision=PRECISION)
    tl.store(dst_ptr + hv * stride_sh + tile0, s0.to(dst_ptr.dtype.element_ty), mask=m0)
    if TWO_HALVES:
        tl.store(dst_ptr + hv * stride_sh + tile1, s1.to(dst_ptr.dtype.element_ty), mask=m1)


@triton.jit
def _chunk_output_kernel(q_ptr, g_ptr, u_ptr, a_ptr, rq_ptr, h_ptr, o_ptr, c_begin, T, DK, DV, GROUP,
                         stride_qt, stride_qh, stride_gt, stride_ut, stride_uh, stride_at, stride_ah, stride_rt,
                         stride_hc, stride_hh, stride_ot, stride_oh, C: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, TWO_HALVES: tl.constexpr, PRECISION: tl.constexpr):
    c = c_begin + tl.program_id(0)
    hv = tl.program_id(1).to(tl.int64)
    hk = hv // GROUP
    rows = tl.arange(0, C)
    offs_k = tl.arange(0, BLOCK_K)
    v0 = tl.program_id(2) * BLOCK_V
    offs_v = v0 + tl.arange(0, BLOCK_V)
    mv = offs_v < DV
    t0 = c * C
    offs_t = t0.to(tl.int64) + rows
    mt = offs_t < T
    cum = tl.cumsum(tl.load(g_ptr + offs_t * stride_gt + hv, mask=mt, other=0).to(tl.float32), axis=0)
    q_in = (tl.load(rq_ptr + offs_t * stride_rt + hv, mask=mt, other=0) * tl.exp(cum))[:, None]
    h = h_ptr + tl.program_id(0).to(tl.int64) * stride_hc + hv * stride_hh + offs_k[:, None] * DV + offs_v[None, :]
    delta = _rows(u_ptr, t0, rows, mt, stride_ut, hv * stride_uh, v0, DV, BLOCK_V)
    q0 = _rows(q_ptr, t0, rows, mt, stride_qt, hk * stride_qh, 0, DK, BLOCK_K)
    h0 = tl.load(h, mask=(offs_k < DK)[:, None] & mv[None, :], other=0)
    qh = tl.dot(q0, h0, input_precision=PRECISION)
    if TWO_HALVES:
        q1 = _rows(q_ptr, t0, rows, mt, stride_qt, hk * stride_qh, BLOCK_K, DK, BLOCK_K)
        h1 = tl.load(h + BLOCK_K * DV, mask=(BLOCK_K + offs_k < DK)[:, None] & mv[None, :], other=0)
        qh = tl.dot(q1, h1, qh, input_precision=PRECISION)
    o = tl.dot(_rows(a_ptr, t0, rows, mt, stride_at, hv * stride_ah, 0, C, C), delta, qh * q_in,
               input_precision=PRECISION)
    _store_rows(o_ptr, o, t0, rows, mt, stride_ot, hv * stride_oh, v0, DV, BLOCK_V)


def scan_tiles(dk: int, min_half: int = 64) -> tuple[int, bool]:
    """(BLOCK_K, TWO_HALVES) of the scan: Dk padded to a power of two, split in two tiles when each is at least
    `min_half` rows (Dk 128 -> two 64-row tiles)."""
    block = max(16, triton.next_power_of_2(dk))
    return (block // 2, True) if block >= 2 * min_half else (block, False)


def chunk_launch_params(dk: int, dv: int) -> dict:
    """Tiles, warps and pipeline stages on a GPU, chosen to compile without register spills for sm_80 and sm_90 at
    Dk = Dv = 128 (tests/kernels/test_cuda_compile.py; not timed). The state pass runs HV x Dv/16 programs (384 for
    Qwen3.5's 48 heads), the output pass chunks x HV x Dv/64. (A wider state slice, 32 columns, compiles at 255
    registers on sm_80: no margin.)"""
    block_k, halves = scan_tiles(dk)
    return {"prepare_k": min(32, max(16, triton.next_power_of_2(dk))),
            "prepare_v": min(32, max(16, triton.next_power_of_2(dv))), "prepare_warps": 8,
            "block_k": block_k, "halves": halves, "state_v": 16, "state_warps": 8,
            "out_v": min(64, max(16, triton.next_power_of_2(dv))), "out_warps": 4, "stages": 1}


GPU_PRECISION = "tf32"  # tf32 products, float32 sums: fp32 dots ("ieee", "tf32x3") spill registers
SEGMENT_CHUNKS = 32  # chunk states kept at a time: 32 x HV x Dk x Dv float32 (96 MiB at 48 x 128 x 128)


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
    p = chunk_launch_params(DK, DV)
    interpreted = is_interpreted(_chunk_state_kernel)
    if interpreted:  # IEEE float32 dots; 16-wide tiles, so that the tests walk every loop and the two-tile state at
        # small head dims
        block_k, halves = scan_tiles(DK, 16)
        p.update(prepare_k=16, prepare_v=16, block_k=block_k, halves=halves, state_v=16, out_v=16)
    prec = "ieee" if interpreted else GPU_PRECISION
    f32 = dict(dtype=torch.float32, device=q.device)
    w, u, scores = torch.empty(T, HV, DK, **f32), torch.empty(T, HV, DV, **f32), torch.empty(T, HV, CHUNK, **f32)
    rq, rk = torch.empty(T, HV, **f32), torch.empty(T, HV, **f32)
    n_chunks = triton.cdiv(T, CHUNK)
    _chunk_prepare_kernel[(n_chunks, HV)](
        q, k, v, g, beta, w, u, scores, rq, rk, T, DK, DV, HV // HK, DK ** -0.5, NORM_EPS, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), w.stride(0), w.stride(1),
        u.stride(0), u.stride(1), scores.stride(0), scores.stride(1), rq.stride(0),
        C=CHUNK, BLOCK_K=p["prepare_k"], BLOCK_V=p["prepare_v"], PRECISION=prec, num_warps=p["prepare_warps"],
        num_stages=p["stages"])
    pool_state = state[int(slot)]
    h = torch.empty(min(n_chunks, SEGMENT_CHUNKS), HV, DK, DV, **f32)
    carry = None  # the float32 state between segments: the pool's slot is read once and stored once
    tiles = dict(C=CHUNK, BLOCK_K=p["block_k"], TWO_HALVES=p["halves"], PRECISION=prec, num_stages=p["stages"])
    for c0 in range(0, n_chunks, SEGMENT_CHUNKS):
        c1 = min(c0 + SEGMENT_CHUNKS, n_chunks)
        src = pool_state if c0 == 0 else carry
        if c1 < n_chunks and carry is None:
            carry = torch.empty_strided(pool_state.shape, pool_state.stride(), **f32)
        dst = pool_state if c1 == n_chunks else carry
        _chunk_state_kernel[(HV, triton.cdiv(DV, p["state_v"]))](
            k, g, w, u, rk, h, src, dst, c0, c1, T, DK, DV, HV // HK, k.stride(0), k.stride(1), g.stride(0),
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), rq.stride(0), h.stride(0), h.stride(1),
            pool_state.stride(0), pool_state.stride(1), BLOCK_V=p["state_v"], num_warps=p["state_warps"], **tiles)
        _chunk_output_kernel[(c1 - c0, HV, triton.cdiv(DV, p["out_v"]))](
            q, g, u, scores, rq, h, o, c0, T, DK, DV, HV // HK, q.stride(0), q.stride(1), g.stride(0), u.stride(0),
            u.stride(1), scores.stride(0), scores.stride(1), rq.stride(0), h.stride(0), h.stride(1), o.stride(0),
            o.stride(1), BLOCK_V=p["out_v"], num_warps=p["out_warps"], **tiles)
    return o
