"""Triton: paged decode attention (one query token per sequence) with GQA and an online softmax in float32.

Twin: `kernels.reference.paged_decode_attention_ref` (gather the pages, SDPA in float32).

Layout: q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D] (float32/float16/bfloat16, the engine's
KVCache layout); page_table int32 [B, max_pages]; ctx_lens int32 [B]; out [B, Hq, D] in q.dtype.

Program (b, kv head h) serves all Hq/Hkv query heads of that kv head, so each K/V page row is read once per group:
the group's queries form a [BLOCK_G >= 16, D] tile (padded rows are zero and never stored) and each page is one
tl.dot for the scores and one for P @ V. Running max/sum/accumulator are float32 (exp2 with log2(e) folded into the
scale). Pages past the context are never read; rows past ctx_len in the last page are masked to -inf.

Extension point for quantized K/V pages (the KV-memory work): `_load_kv_page` is the only place that reads the
cache. A new KV_FMT code adds its decode there (e.g. int8/fp8 rows times a per-page-per-head scale passed as extra
pointers), and `paged_decode_attention` gains the scale tensors; the softmax loop stays as it is.

Not done yet (no GPU to tune on): split-K over the context ("flash decoding") for small batches with long contexts,
where B * Hkv programs leave most SMs idle.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted

KV_FLOAT = 0  # KV_FMT code: plain float pages (the only one so far)


@triton.jit
def _load_kv_page(cache_ptr, page, offs_t, offs_d, mask, stride_p, stride_t, head_off, KV_FMT: tl.constexpr):
    """[PAGE, BLOCK_D] float32 rows of one page for one kv head. Quantized page formats decode here."""
    ptrs = cache_ptr + page * stride_p + head_off + offs_t[:, None] * stride_t + offs_d[None, :]
    if KV_FMT == 0:
        tile = tl.load(ptrs, mask=mask, other=0).to(tl.float32)
    return tile


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, len_ptr, o_ptr, qk_scale,
                         stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                         stride_ptb, stride_ob, stride_oh, D, GROUP,
                         PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         KV_FMT: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, PAGE)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = h * GROUP + offs_g
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0)
    q = q.to(tl.float32) * qk_scale  # qk_scale = softmax scale * log2(e)

    ctx = tl.load(len_ptr + b)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_head = h.to(tl.int64) * stride_kh
    v_head = h.to(tl.int64) * stride_vh
    for p in range(0, tl.cdiv(ctx, PAGE)):
        page = tl.load(pt_ptr + b.to(tl.int64) * stride_ptb + p).to(tl.int64)
        t_valid = p * PAGE + offs_t < ctx
        kv_mask = t_valid[:, None] & d_mask[None, :]
        k = _load_kv_page(k_ptr, page, offs_t, offs_d, kv_mask, stride_kp, stride_kt, k_head, KV_FMT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, PAGE], log2 domain
        s = tl.where(t_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        pr = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        v = _load_kv_page(v_ptr, page, offs_t, offs_d, kv_mask, stride_vp, stride_vt, v_head, KV_FMT)
        acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qo_mask)


def launch_params(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps): no register spills on sm_90 for head dims 64 and 128 (ptxas -v; checked by
    tests/kernels/test_cuda_compile.py)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return block_d, 8 if block_d <= 64 else 4


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: Optional[float] = None,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See the module docstring. `scale` defaults to D ** -0.5."""
    B, Hq, D = q.shape
    _, page_size, Hkv, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"K/V caches {list(k_cache.shape)}/{list(v_cache.shape)} do not match q head dim {D}")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} kv heads")
    if page_size & (page_size - 1) or page_size < 16:
        raise ValueError(f"page_size {page_size} must be a power of two >= 16")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the K/V caches must be contiguous in the head dim")
    page_table = page_table.to(torch.int32)
    ctx_lens = ctx_lens.to(device=q.device, dtype=torch.int32).contiguous()
    if out is None:
        out = torch.empty_like(q)
    group = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    block_d, warps = launch_params(D)
    prec = "ieee" if k_cache.dtype == torch.float32 or is_interpreted(_paged_decode_kernel) else "tf32"
    _paged_decode_kernel[(B, Hkv)](
        q, k_cache, v_cache, page_table, ctx_lens, out, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0), out.stride(0), out.stride(1),
        D, group, PAGE=page_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, KV_FMT=KV_FLOAT, PRECISION=prec, num_warps=warps)
    return out
