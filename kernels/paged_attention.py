"""Triton: paged decode attention (one query token per sequence) with GQA and an online softmax in float32, over
float or quantized K/V pages.

Twin: `kernels.reference.paged_decode_attention_ref` (gather the pages, dequantize with `kv_dequantize_ref`, SDPA in
float32).

Layout: q [B, Hq, D]; page_table int32 [B, max_pages]; ctx_lens int32 [B]; out [B, Hq, D] in q.dtype. Each of K and
V is one layer of the engine's KVCache (docs/KV.md), every tensor [num_pages, page_size, Hkv, ...]:
  float  data float32/float16/bfloat16 [.., D], no scale;
  int8   data int8 [.., D] and scale fp16 [.., 1]: value = code * scale;
  int4   data uint8 [.., D/2] (element 2j in the low nibble of byte j, stored as q + 8) and scale fp16 [.., D/G]:
         value = (nibble - 8) * scale[d // G], G the group (32, or the largest even divisor of D up to 32).
The part's format follows from the data dtype (float / int8 / uint8); so k8v8, k8v4, k4v4 and rk4v4 need no flag.
For rk4v4 the keys are stored Hadamard-rotated: the caller passes queries rotated the same way
(KVCache.rotate_queries), the kernel does not rotate.

Program (b, kv head h) serves all Hq/Hkv query heads of that kv head, so each K/V page row is read once per group:
the group's queries form a [BLOCK_G >= 16, D] tile (padded rows are zero and never stored) and each tile of BLOCK_T
rows (a whole page; half a page for D 256, see launch_params) is one tl.dot for the scores and one for P @ V.
`_load_kv_page` reads the codes and decodes them to a [BLOCK_T, BLOCK_D] float32 tile in registers. int4: the two
nibbles are joined into channel order and multiplied by their group scales ([BLOCK_T, D/G] loaded once, broadcast
over each group; a group that is not a power of two, e.g. 20 for D 80, gathers per channel); each product code *
scale is exact in float32, so the tile equals the twin's dequantized rows bit for bit. int8 rows have one scale
each, which multiplies the scores and the probabilities (`_row_scales`) instead of the tile: the same numbers up to
float32 rounding, with fewer registers. Running max/sum/accumulator are float32 (exp2 with log2(e) folded into the
scale). Pages past the context are never read; rows past ctx_len in the last page are masked to -inf.

Dots: "ieee" in the interpreter; on a GPU, float pages: "ieee" for float32 pages, else "tf32" (half values are exact
in tf32); quantized pages: "tf32" with bf16 queries (its rounding stays within the bf16 tolerance), else "tf32x3"
(about float32 accuracy; "ieee" spills registers there).

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

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_kv_page(ptr, s_ptr, page, offs_t, offs_d, t_valid, D, stride_p, stride_t, head_off, s_stride_p,
                  s_stride_t, s_head_off, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """[BLOCK_T, BLOCK_D] float32 rows (offs_t) of one page for one kv head (zeros past ctx_len and past D).
    BITS 0: float pages; 8: the int8 codes, NOT scaled (see `_row_scales`); 4: packed int4 codes times each
    channel's group scale."""
    mask = t_valid[:, None] & (offs_d < D)[None, :]
    rows = ptr + page * stride_p + head_off + offs_t[:, None] * stride_t
    if BITS == 0:
        tile = tl.load(rows + offs_d[None, :], mask=mask, other=0).to(tl.float32)
    else:
        srows = s_ptr + page * s_stride_p + s_head_off + offs_t * s_stride_t  # [BLOCK_T] pointers to each row's scales
        if BITS == 8:  # codes only: the caller applies the row scales to the [BLOCK_G, BLOCK_T] side of the dot
            tile = tl.load(rows + offs_d[None, :], mask=mask, other=0).to(tl.float32)
        else:
            offs_j = tl.arange(0, BLOCK_D // 2)
            bmask = t_valid[:, None] & (offs_j < D // 2)[None, :]
            packed = tl.load(rows + offs_j[None, :], mask=bmask, other=0).to(tl.int32)
            lo = (packed & 15).to(tl.float32) - 8.0
            hi = ((packed >> 4) & 15).to(tl.float32) - 8.0
            codes = tl.reshape(tl.join(lo, hi), (BLOCK_T, BLOCK_D))  # channel 2j = low nibble of byte j
            if (GROUP & (GROUP - 1)) == 0:  # [BLOCK_T, NG] scales broadcast over their groups (few registers)
                NG: tl.constexpr = BLOCK_D // GROUP
                offs_s = tl.arange(0, NG)
                s = tl.load(srows[:, None] + offs_s[None, :], mask=t_valid[:, None] & (offs_s < D // GROUP)[None, :],
                            other=0).to(tl.float32)
                tile = tl.reshape(tl.reshape(codes, (BLOCK_T, NG, GROUP)) * s[:, :, None], (BLOCK_T, BLOCK_D))
            else:  # a group such as 20 (D = 80): each channel gathers its group's scale
                s = tl.load(srows[:, None] + offs_d[None, :] // GROUP, mask=mask, other=0).to(tl.float32)
                tile = codes * s
    return tile


@triton.jit
def _row_scales(s_ptr, page, offs_t, t_valid, s_stride_p, s_stride_t, s_head_off):
    """[BLOCK_T] float32: the one scale of each int8 row (0 past ctx_len). Scaling the [BLOCK_G, BLOCK_T] scores, or the
    probabilities before P @ V, costs BLOCK_T * BLOCK_G multiplies instead of BLOCK_T * BLOCK_D (and registers)."""
    return tl.load(s_ptr + page * s_stride_p + s_head_off + offs_t * s_stride_t, mask=t_valid, other=0).to(tl.float32)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, pt_ptr, len_ptr, o_ptr, qk_scale,
                         stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_ksp, stride_kst, stride_ksh,
                         stride_vp, stride_vt, stride_vh, stride_vsp, stride_vst, stride_vsh,
                         stride_ptb, stride_ob, stride_oh, D, GROUP,
                         PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         K_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                         PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_b = tl.arange(0, BLOCK_T)
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
    h64 = h.to(tl.int64)
    for i in range(0, tl.cdiv(ctx, BLOCK_T)):  # BLOCK_T rows (a page, or a part of one) at a time
        start = i * BLOCK_T
        page = tl.load(pt_ptr + b.to(tl.int64) * stride_ptb + start // PAGE).to(tl.int64)
        offs_t = start % PAGE + offs_b
        t_valid = start + offs_b < ctx
        k = _load_kv_page(k_ptr, ks_ptr, page, offs_t, offs_d, t_valid, D, stride_kp, stride_kt, h64 * stride_kh,
                          stride_ksp, stride_kst, h64 * stride_ksh, K_BITS, K_GROUP, BLOCK_T, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, BLOCK_T], log2 domain
        if K_BITS == 8:
            s = s * _row_scales(ks_ptr, page, offs_t, t_valid, stride_ksp, stride_kst, h64 * stride_ksh)[None, :]
        s = tl.where(t_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        pr = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        v = _load_kv_page(v_ptr, vs_ptr, page, offs_t, offs_d, t_valid, D, stride_vp, stride_vt, h64 * stride_vh,
                          stride_vsp, stride_vst, h64 * stride_vsh, V_BITS, V_GROUP, BLOCK_T, BLOCK_D)
        if V_BITS == 8:
            pv = pr * _row_scales(vs_ptr, page, offs_t, t_valid, stride_vsp, stride_vst, h64 * stride_vsh)[None, :]
        else:
            pv = pr
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qo_mask)


def launch_params(head_dim: int, quantized: bool = False, precision: str = "tf32",
                  page_size: int = 64) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_T, num_warps) on a GPU: no register spills at sm_80/sm_90 (ptxas -v, checked by
    tests/kernels/test_cuda_compile.py) for float pages at D 64/128, and quantized pages at D 64/128 and, with bf16
    queries, 256 (D 96 compiles as 128). BLOCK_T rows of a page are one tile: the whole page, or half of it for D 256
    and for quantized pages read with "tf32x3" dots at D 128. Not spill-free: float32 queries over quantized pages
    at D 256."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    half = block_d >= 256 or (quantized and precision == "tf32x3" and block_d >= 128)
    block_t = min(page_size, 32 if half else 64)
    if quantized:
        return block_d, block_t, 8
    return block_d, block_t, 8 if block_d <= 64 else 4


def dot_precision(q_dtype: torch.dtype, page_dtype: torch.dtype, quantized: bool) -> str:
    """tl.dot input precision on a GPU (module docstring, "Dots")."""
    if quantized:
        return "tf32" if q_dtype == torch.bfloat16 else "tf32x3"
    return "ieee" if page_dtype == torch.float32 else "tf32"


def part_format(data: torch.Tensor, scale: Optional[torch.Tensor], head_dim: int, what: str) -> tuple[int, int]:
    """(bits, group) of one of K/V from its tensors: bits 0 for float pages, 8 for int8 codes, 4 for packed int4
    codes (uint8); group = channels per scale (int4 only; 1 otherwise, a constexpr that then goes unused)."""
    n = data.shape[-1]
    if scale is None:
        if data.dtype not in FLOAT_DTYPES or n != head_dim:
            raise ValueError(f"{what} pages {data.dtype} [.., {n}] are not float pages of head dim {head_dim}")
        return 0, 1
    if scale.shape[:-1] != data.shape[:-1] or scale.stride(-1) != 1:
        raise ValueError(f"{what} scales {list(scale.shape)} do not match its codes {list(data.shape)}")
    groups = scale.shape[-1]
    if data.dtype == torch.int8 and n == head_dim and groups == 1:
        return 8, 1
    if data.dtype == torch.uint8 and 2 * n == head_dim and head_dim % groups == 0 and (head_dim // groups) % 2 == 0:
        return 4, head_dim // groups
    raise ValueError(f"{what}: codes {data.dtype} [.., {n}] with {groups} scales per row are neither int8 (D codes, "
                     f"one scale) nor packed int4 (D/2 bytes, D/G scales, G even) for head dim {head_dim}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: Optional[float] = None,
                           out: Optional[torch.Tensor] = None, k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None, block_t: Optional[int] = None) -> torch.Tensor:
    """See the module docstring. `scale` defaults to D ** -0.5; `k_scale`/`v_scale` are given for quantized parts;
    `block_t` overrides the rows per tile (tests: sub-page tiles in the interpreter)."""
    B, Hq, D = q.shape
    _, page_size, Hkv = k_cache.shape[:3]
    kbits, kgroup = part_format(k_cache, k_scale, D, "K")
    vbits, vgroup = part_format(v_cache, v_scale, D, "V")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"K/V caches {list(k_cache.shape)}/{list(v_cache.shape)} do not match")
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
    quantized = bool(kbits or vbits)
    gpu_prec = dot_precision(q.dtype, k_cache.dtype, quantized)
    block_d, default_t, warps = launch_params(D, quantized, gpu_prec, page_size)
    if block_t is not None and (block_t < 16 or page_size % block_t or block_t & (block_t - 1)):
        raise ValueError(f"block_t {block_t} must be a power of two >= 16 dividing the page size {page_size}")
    if is_interpreted(_paged_decode_kernel):
        prec, block_t = "ieee", block_t or page_size  # the interpreter pays per loop step: whole pages
    else:
        prec, block_t = gpu_prec, block_t or default_t
    ks = k_scale if k_scale is not None else k_cache  # a float part's scale pointer is never read
    vs = v_scale if v_scale is not None else v_cache
    _paged_decode_kernel[(B, Hkv)](
        q, k_cache, ks, v_cache, vs, page_table, ctx_lens, out, scale * math.log2(math.e),
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *ks.stride()[:3], *v_cache.stride()[:3], *vs.stride()[:3],
        page_table.stride(0), out.stride(0), out.stride(1), D, group,
        PAGE=page_size, BLOCK_T=block_t, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        K_BITS=kbits, K_GROUP=kgroup, V_BITS=vbits, V_GROUP=vgroup, PRECISION=prec, num_warps=warps)
    return out
