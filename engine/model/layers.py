"""The building blocks of a decoder layer: RMSNorm, rotary embeddings, paged attention, gated MLP."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.batch import ForwardBatch
from engine.model.vision_positions import mrope_angles
from kernels import cpu_native, dispatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalizes the last dim in float32 and scales by `weight` ([D], or one row per head [H, D] for x [T, H, D])."""
    if dispatch.use_triton(x.device) and weight.dim() == 1:  # the fused Triton kernel (kernels/rms_norm.py)
        return dispatch.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dim() == 1:  # one op instead of six (decode is op-bound on the CPU)
        if x.device.type == "cpu" and weight.dtype == torch.float32 and cpu_native.loaded():
            return cpu_native.rms_norm(x, weight, eps)  # ATen's takes ~25 us a row
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if dispatch.use_triton(gate_up.device):
        return dispatch.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Rotary:
    """Rotary position embedding in the half-split (HF) layout, with llama3/linear scaling and GGUF freq factors."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, freq_factors: torch.Tensor | None,
                 device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.position_scale = 1.0
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        if scaling:
            kind = scaling.get("rope_type")
            if kind == "linear":
                self.position_scale = 1.0 / float(scaling["factor"])
            elif kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            else:
                raise ModelLoadError(f"RoPE scaling '{kind}' is not supported.",
                                     "Supported: default, linear, llama3.")
        self.inv_freq = inv_freq
        self.device = device
        self.cos = self.sin = torch.empty(0)

    def _extend(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 4096)
        t = torch.arange(n, dtype=torch.float64) * self.position_scale
        freqs = torch.outer(t, self.inv_freq)
        self.cos = freqs.cos().float().to(self.device)
        self.sin = freqs.sin().float().to(self.device)

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's rotation tables for the torch path, [T, 1, D] each: (cos | cos) and (-sin | sin), so that
        rope(x) = x * c + swap_halves(x) * s. Built once per forward, shared by every layer (None where the Triton
        kernel rotates)."""
        if max_position >= self.cos.shape[0]:
            self._extend(max_position + 1)
        if dispatch.use_triton(positions.device):
            return None
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    def mrope_tables(self, positions: torch.Tensor, section) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of tables() for M-RoPE positions [3, T] (engine/model/vision_positions.mrope_angles,
        `section` the config's mrope_section), on every device: a step with images rotates on the torch path."""
        angles = mrope_angles(positions, self.inv_freq, section).to(positions.device)
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, max_position: int,
                 tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [T, H, D]; rotates each head of each token by its position (`tables`: this step's, from tables())."""
        if max_position >= self.cos.shape[0]:
            self._extend(max_position + 1)
        if tables is None and dispatch.use_triton(x.device):
            return dispatch.rope(x, positions, self.cos, self.sin)
        c, s = tables if tables is not None else self.tables(positions, max_position)
        half = x.shape[-1] // 2
        xf = x if x.dtype == torch.float32 else x.float()
        out = xf * c + torch.cat((xf[..., half:], xf[..., :half]), -1) * s
        return out if out.dtype == x.dtype else out.to(x.dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


FEW_QUERIES = 16  # decode and verification steps: grouped_attention; longer chunks: SDPA


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """Attention of a few query rows, GQA-aware without copying K/V per query head: q [Hq, L, D], k/v [Hkv, ctx, D],
    mask [L, ctx] (True = may attend) or None. The query heads of one KV head become one [group * L, D] matrix (3x
    faster than SDPA's math path with enable_gqa on the CPU, which repeats K and V for every query head)."""
    hkv, ctx, d = k.shape
    hq, length = q.shape[0], q.shape[1]
    group = hq // hkv
    qg = q.reshape(hkv, group * length, d)
    if qg.dtype == torch.float32:  # the scale rides on the GEMM: one ATen call less per layer (decode is op-bound)
        scores = torch.baddbmm(qg.new_empty(()), qg, k.transpose(1, 2), beta=0, alpha=scale)
    else:
        scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale
    if mask is not None:
        scores = scores.view(hkv, group, length, ctx).masked_fill(~mask, float("-inf")).view(hkv, group * length, ctx)
    probs = scores.softmax(-1)
    return torch.bmm(probs if v.dtype == torch.float32 else probs.to(v.dtype), v).view(hq, length, d)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         causal: bool = False) -> torch.Tensor:
    """SDPA of q [Hq, L, D] over k/v [Hkv, ctx, D] (GQA), mask [L, ctx] (True = may attend) or causal. Given a batch
    dimension, the CPU takes its flash kernel (4x faster for a 512-token chunk than the math path it takes for
    3-D tensors)."""
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale,
                                       enable_gqa=True)
    return o[0]


def static_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
                           scale: float) -> torch.Tensor:
    """Attention of a decode step (engine/model/graphs.py), q/k/v [B, H, D], one token per row: writes k/v to the
    rows' slots, then every row attends over its page-table row up to its context length through the paged decode
    kernel (Triton where it runs, its PyTorch twin otherwise), reading float or quantized pages in place; or, where
    the table lists its rows' pages on the host (the CPU), row by row over views of them."""
    cache, table = batch.kv, batch.decode
    cache.write(layer, batch.slots, k, v)
    q = cache.rotate_queries(q)
    if table.span is not None:  # one row over its consecutive pages (the compiled CPU step): views of the cache
        keys, values = cache.span(layer, *table.span, q.dtype)
        return grouped_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), None,
                                 scale).transpose(0, 1)
    if table.rows is None:
        return cache.decode_attention(layer, q, table.page_table, table.ctx_lens, scale)
    if len(table.rows) == 1:
        return _plain_rows(cache, layer, q, table.rows[0], scale)
    out = torch.empty_like(q)
    for s in table.rows:
        out[s.q_start] = _plain_rows(cache, layer, q, s, scale)[0]
    return out


def _plain_rows(cache, layer: int, q: torch.Tensor, s, scale: float) -> torch.Tensor:
    """The rows of one sequence over its plain page list: its K/V gathered (a view where the pages are consecutive
    and float), grouped attention for a few queries, SDPA for longer chunks; [q_len, Hq, D]."""
    keys, values = cache.gather(layer, s.pages, s.ctx_len, q.dtype, s.first_page)  # [ctx, Hkv, D], in q's dtype
    qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)
    kt, vt = keys.transpose(0, 1), values.transpose(0, 1)
    if s.q_len <= FEW_QUERIES:
        o = grouped_attention(qs, kt, vt, None if s.q_len == 1 else s.causal_mask(q.device), scale)
    elif s.q_len == s.ctx_len:
        o = sdpa(qs, kt, vt, None, scale, causal=True)
    else:
        o = sdpa(qs, kt, vt, s.causal_mask(q.device), scale)
    return o.transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
                    scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens. Writes k/v into the pages, then attends each sequence
    over its whole context (earlier pages plus this step), causally within the step."""
    if batch.decode is not None:  # a decode step (engine/model/graphs.py): the page table, fixed shapes
        return static_paged_attention(q, k, v, layer, batch, scale)
    cache = batch.kv
    cache.write(layer, batch.slots, k, v)  # quantizes for the k8/k4/v8/v4 formats
    # rk* formats keep K Hadamard-rotated: rotating this step's q (T rows) is cheaper than un-rotating every K row
    q = cache.rotate_queries(q)
    single = len(batch.seqs) == 1  # the whole step is one sequence: its result is the output, no buffer to fill
    out = None if single else torch.empty_like(q)
    for s in batch.seqs:
        if s.tiers is not None and s.q_len == 1 and dispatch.use_triton(q.device):
            # windowed decode on CUDA: the kernel reads the sink, retrieved and window pages in place
            qs = q[s.q_start:s.q_start + 1]
            pages, length, _ = s.tiers.page_list(cache, layer, qs, s.ctx_len)
            rows = cache.decode_attention(layer, qs, pages[None], s.ctx_lens(q.device, length), scale)
        elif s.tiers is not None:  # a windowed sequence: sink + retrieved + window pages (engine/memory/kv/window.py)
            qs = q[s.q_start:s.q_start + s.q_len]
            keys, values, mask = s.tiers.context(cache, layer, qs, s.ctx_len, q.dtype)
            qt, kt, vt = qs.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
            if s.q_len <= FEW_QUERIES:
                o = grouped_attention(qt, kt, vt, mask, scale)
            else:
                o = sdpa(qt, kt, vt, mask, scale)
            rows = o.transpose(0, 1)
        elif s.q_len == 1 and dispatch.use_triton(q.device):
            # one token on CUDA (a verification or mixed step): the Triton kernel reads the pages in place, float or
            # quantized (dequantized in registers; rk* keys against the rotated q above) (kernels/paged_attention.py)
            rows = cache.decode_attention(layer, q[s.q_start:s.q_start + 1], s.pages[None], s.ctx_lens(q.device),
                                          scale)
        else:
            rows = _plain_rows(cache, layer, q, s, scale)
        if single:
            return rows
        out[s.q_start:s.q_start + s.q_len] = rows
    return out
