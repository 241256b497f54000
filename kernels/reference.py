"""The PyTorch twins: each one DEFINES what the Triton kernel of the same name must compute (up to the tolerances in
docs/KERNELS.md). They are also the portable fallback `kernels.dispatch` uses where Triton does not run.

All arithmetic is float32; results are cast once to the output dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kernels.quant import QuantizedWeight, dequantize, row_slice

__all__ = ["dequantize", "quant_linear_ref", "int16_rows", "lowbit_linear_ref", "rms_norm_ref", "rope_ref", "rope_tables", "silu_and_mul_ref",
           "kv_dequantize_ref", "paged_decode_attention_ref", "gdn_recurrent_ref", "gdn_chunked_ref",
           "causal_conv_update_ref", "fused_moe_ref"]


def quant_linear_ref(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[..., o] = sum_i x[..., i] * w[o, i] with w = dequantize(qw), in float32, cast to x.dtype."""
    y = x.float() @ dequantize(qw).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


INT16_BLOCK = 32


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 rounded as the C++ low-bit kernel rounds its activations: per block of 32 values, the step
    dx = max|x| / 32767 and x ~ round(x * (32767 / max|x|)) * dx (to nearest, ties to even). Returned as float32."""
    b = x.float().reshape(x.shape[0], -1, INT16_BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / torch.where(amax > 0, amax, 1), 0)
    return (torch.round(b * inv).clamp(-32767, 32767) * (amax / 32767)).reshape(x.shape)


def lowbit_linear_ref(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The twin of the C++ `lowbit_linear`: the codes' part of the weight (c * d) times x rounded by `int16_rows`,
    the mins' part (m, or -8 d for symmetric 4-bit) times x itself; float64, returned as float32."""
    w = dequantize(qw).double()
    part = torch.zeros_like(w)
    if qw.mins is not None or qw.format == "int4_sym":
        m = qw.mins.double() if qw.mins is not None else -8 * qw.scales.double()
        part = m.repeat_interleave(qw.group_size, dim=1)
    y = int16_rows(x).double() @ (w - part).T + x.double() @ part.T
    return y.float()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """HF Llama RMSNorm over the last dim: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in float32.
    With `residual`: h = x + residual (rounded to x.dtype) is normalized and returned as the new residual:
    returns (normed, h). Output dtype = promote(x.dtype, weight.dtype), as in the engine's layer."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * n
    return out if residual is None else (out, x)


def rope_tables(head_dim: int, theta: float, n_positions: int, device: torch.device | str = "cpu"):
    """(cos, sin) float32 [n_positions, head_dim // 2] for the default (unscaled) RoPE; inv_freq in float64 as in
    engine/model/layers.py."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(n_positions, dtype=torch.float64), inv_freq)
    return freqs.cos().float().to(device), freqs.sin().float().to(device)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX/HF) rotary embedding: x [T, H, D], positions [T], cos/sin [P, D/2] ->
    cat(x1*cos - x2*sin, x2*cos + x1*sin) with x1 = x[..., :D/2], x2 = x[..., D/2:], i.e. x*cos + rotate_half(x)*sin."""
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2N] -> [..., N]: silu(x[..., :N]) * x[..., N:], float32, one rounding to x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def kv_dequantize_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """KV-cache rows [..., D] in float32 from their codes and fp16 scales (docs/KV.md; the twin of
    engine.memory.kv.quant.dequantize, tested bit-identical to it): int8 codes [..., D] times one scale [..., 1]; packed
    int4 uint8 [..., D/2] (element 2j in the low nibble of byte j, stored as q + 8) times the scale of each channel's
    group [..., D/G]. Each product is exact in float32."""
    if codes.dtype == torch.int8:
        q = codes.float()
    elif codes.dtype == torch.uint8:
        c = codes.to(torch.int32)
        q = torch.stack(((c & 15), (c >> 4)), dim=-1).flatten(-2).float() - 8.0
    else:
        raise ValueError(f"KV codes must be int8 or packed int4 (uint8), got {codes.dtype}")
    g = q.shape[-1] // scales.shape[-1]
    return (q.unflatten(-1, (-1, g)) * scales.float().unsqueeze(-1)).flatten(-2)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, ctx_lens: torch.Tensor,
                               scale: Optional[float] = None, k_scale: Optional[torch.Tensor] = None,
                               v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode query per sequence over its paged context.

    q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D] floats, or quantized codes (int8 [.., D] or packed
    int4 uint8 [.., D/2]) with their fp16 scales k_scale/v_scale [num_pages, page_size, Hkv, D/G] (one layer of the
    engine's KVCache; dequantized with `kv_dequantize_ref`; rk* keys are used as stored, so q must come rotated);
    page_table int [B, max_pages] (sequence b's token p lives in page page_table[b, p // page_size], row
    p % page_size); ctx_lens [B] (tokens to attend, the query's own token included). Hq % Hkv == 0 (GQA: q head h
    reads kv head h // (Hq // Hkv)). softmax(q.k * scale) @ v in float32; a sequence with ctx_len 0 gets zeros.
    Returns [B, Hq, D] in q.dtype."""
    B, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)

    def rows(data, scales, pages, n):
        x = data.index_select(0, pages).flatten(0, 1)[:n]
        if scales is None:
            return x.float()
        return kv_dequantize_ref(x, scales.index_select(0, pages).flatten(0, 1)[:n])

    for b in range(B):
        n = int(ctx_lens[b])
        if n == 0:
            continue
        pages = page_table[b, :(n + page_size - 1) // page_size].long()
        k = rows(k_cache, k_scale, pages, n).transpose(0, 1)  # [Hkv, n, D]
        v = rows(v_cache, v_scale, pages, n).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=scale, enable_gqa=True)
        out[b] = o.squeeze(1)
    return out.to(q.dtype)


def quest_bounds_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest bounds: q [T, Hq, D], kmin/kmax [N, Hkv, D] -> [N, T, Hkv, G] (query head h reads KV head h // G),
    sum_i max(q_i * min_i, q_i * max_i), in float32. Twin of kernels.quest.quest_bounds."""
    t, hq, d = q.shape
    hkv = kmin.shape[1]
    qg = q.float().view(t, hkv, hq // hkv, d)
    return (torch.einsum("thgd,nhd->nthg", qg.clamp(min=0), kmax.float())
            + torch.einsum("thgd,nhd->nthg", qg.clamp(max=0), kmin.float()))


# ---------------------------------------------------------------------------------------------------- gated delta rule
GDN_NORM_EPS = 1e-6
GDN_CHUNK = 64


def _gdn_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k L2-normalised over the last dim (x * rsqrt(sum x^2 + 1e-6)), q also scaled by Dk^-0.5; float32."""
    q, k = q.float(), k.float()
    q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + GDN_NORM_EPS) * q.shape[-1] ** -0.5)
    return q, k * torch.rsqrt((k * k).sum(-1, keepdim=True) + GDN_NORM_EPS)


def gdn_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, slots: torch.Tensor,
                      step_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gated delta rule for B sequences of T tokens (decode; T > 1 for draft tokens) over a state pool.

    q, k [B, T, HK, Dk] raw (normalised here, see `_gdn_qk`); v [B, T, HV, Dv]; g, beta [B, T, HV] float32; value head
    h reads key head h // (HV / HK). state [S, HV, Dk, Dv] (float32 or float16 storage), slots int [B]: sequence b
    starts from state[slots[b]] and its state after the T tokens is stored there. Per token, in float32:
    S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q. step_slots int [B, T]: the state after
    token t is also stored in slot step_slots[b, t] unless it is -1. Returns o [B, T, HV, Dv] float32."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    rep = HV // HK
    slots = slots.to(device=state.device, dtype=torch.long)
    qn, kn = _gdn_qk(q, k)
    s = state.index_select(0, slots).float().view(B, HK, rep, DK, DV)  # value heads grouped under their key head
    out = torch.empty(B, T, HV, DV, dtype=torch.float32, device=q.device)
    for t in range(T):
        kt = kn[:, t].view(B, HK, 1, 1, DK)
        s.mul_(g[:, t].float().exp().view(B, HK, rep, 1, 1))
        kv = (kt @ s).view(B, HK, rep, DV)
        delta = beta[:, t].float().view(B, HK, rep, 1) * (v[:, t].float().view(B, HK, rep, DV) - kv)
        s.addcmul_(kt.transpose(-1, -2), delta.unsqueeze(-2))
        out[:, t] = (qn[:, t].view(B, HK, 1, 1, DK) @ s).view(B, HV, DV)
        if step_slots is not None:
            dst = step_slots[:, t].to(device=state.device, dtype=torch.long)
            keep = dst >= 0
            state.index_copy_(0, dst[keep], s.view(B, HV, DK, DV)[keep].to(state.dtype))
    state.index_copy_(0, slots, s.view(B, HV, DK, DV).to(state.dtype))
    return out


def gdn_chunked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, slot: int, chunk: int = GDN_CHUNK) -> torch.Tensor:
    """`gdn_recurrent_ref` for one sequence of T tokens (prefill), computed a chunk at a time: q, k [T, HK, Dk],
    v [T, HV, Dv], g, beta [T, HV]; reads and writes state[slot]; returns o [T, HV, Dv] float32.

    Within a chunk, G = cumsum(g), A[i, j] = beta_i exp(G_i - G_j) k_i . k_j (j < i), u = (I + A)^-1 beta v,
    w = (I + A)^-1 beta exp(G) k; per chunk from the state S: delta = u - w S,
    o = exp(G) q S + (tril(exp(G_i - G_j)) * q k^T) delta, S <- exp(G_last) S + (exp(G_last - G) k)^T delta.
    The tokens past T that pad the last chunk have k = v = 0 and g = beta = 0: they change nothing."""
    T, HK = q.shape[:2]
    HV = v.shape[1]
    rep = HV // HK
    qn, kn = (x.repeat_interleave(rep, dim=1) for x in _gdn_qk(q, k))
    pad = (-T) % chunk

    def chunks(x):  # [T, HV, ...] -> [HV, N, chunk, ...]
        x = x.float().movedim(0, 1)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.unflatten(1, (-1, chunk))

    qc, kc, vc, gc, bc = (chunks(x) for x in (qn, kn, v, g, beta))
    cum = gc.cumsum(-1)  # [HV, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    a = (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    unit = a + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(unit, bc.unsqueeze(-1) * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit, (bc * cum.exp()).unsqueeze(-1) * kc, upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay
    q_in = qc * cum.exp().unsqueeze(-1)
    last = cum[..., -1:]  # [HV, N, 1]
    k_out = kc * (last - cum).exp().unsqueeze(-1)
    s = state[slot].float()
    out = torch.empty_like(u)
    for n in range(cum.shape[1]):
        delta = u[:, n] - w[:, n] @ s
        out[:, n] = q_in[:, n] @ s + scores[:, n] @ delta
        s = s * last[:, n].exp().unsqueeze(-1) + k_out[:, n].transpose(-1, -2) @ delta
    state[slot] = s.to(state.dtype)
    return out.flatten(1, 2)[:, :T].movedim(1, 0).contiguous()


def causal_conv_update_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """One decode step of the depthwise causal convolution + SiLU that feeds the delta rule, for B sequences:
    x [B, C] (this token's channels), weight [C, K], conv_state [S, C, K - 1] (each slot's previous K - 1 inputs, oldest
    first), slots int [B]. out[b, c] = silu(sum_j weight[c, j] * window[c, j]) over the window (the slot's K - 1
    inputs, then x[b]), in float32; the slot then holds the window's last K - 1 inputs (x rounded to its dtype).
    Returns [B, C] float32."""
    slots = slots.to(device=conv_state.device, dtype=torch.long)
    window = torch.cat((conv_state.index_select(0, slots).float(), x.float().unsqueeze(-1)), dim=-1)  # [B, C, K]
    out = F.silu((window * weight.float()).sum(-1))
    conv_state.index_copy_(0, slots, window[..., 1:].to(conv_state.dtype))
    return out


# ------------------------------------------------------------------------------------------------ mixture of experts
def expert_weight(w: torch.Tensor | QuantizedWeight, e: int, n: int) -> torch.Tensor:
    """Expert e's float32 [n, K] of a stack: dense [E, n, K], or a QuantizedWeight [E * n, K] (rows per expert)."""
    return w[e].float() if isinstance(w, torch.Tensor) else dequantize(row_slice(w, e * n, n))


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor | QuantizedWeight, w_down: torch.Tensor | QuantizedWeight,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The routed experts of a MoE MLP: x [T, H]; w_gate_up [E, 2I, H] (gate rows first) and w_down [E, H, I], dense
    or QuantizedWeight stacks [E * 2I, H] / [E * H, I]; weights float32 [T, k]; ids [T, k].
    y[t, j] = weights[t, j] * W_down[e] @ a with a = silu(g) * u, (g, u) = W_gate_up[e] @ x[t], e = ids[t, j], all in
    float32 except a, rounded once to x.dtype (as the gated MLP stores it); out[t] = sum over j in order, cast to
    x.dtype. Only the experts some token picked are read."""
    h = x.shape[1]
    inter = w_down.shape[-1] if isinstance(w_down, torch.Tensor) else w_down.in_features
    y = torch.zeros(*ids.shape, h, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[t].float() @ expert_weight(w_gate_up, e, 2 * inter).T).chunk(2, dim=-1)
        a = (F.silu(gate) * up).to(x.dtype).float()
        y[t, j] = (a @ expert_weight(w_down, e, h).T) * weights[t, j].float().unsqueeze(1)
    return y.sum(1).to(x.dtype)
