"""Triton: the routed experts of a mixture-of-experts MLP in two launches, for dense or low-bit stacked weights.

Twin: `kernels.reference.fused_moe_ref`. out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
e = ids[t, j].

The (token, expert) pairs are grouped by expert and each expert's run padded to BLOCK_M rows (`align_blocks`, the
moe_align_block_size idea), so every block of rows belongs to one expert; blocks past the used ones have expert -1
and return at once. The sizes depend on T, k, E and BLOCK_M only: no host sync, the same grid every step.
  1. program (block, BLOCK_N columns of I): the gate and up rows of the block's expert against its token rows
     (tl.dot over H), silu(gate) * up stored in x.dtype per padded row;
  2. program (block, BLOCK_N columns of H): those rows times the expert's down rows (over I), times the pair's
     routing weight, stored float32 per pair (row t * k + j);
then the k rows of each token are summed in order by one torch sum: deterministic, no atomics.

Weights: dense [E, N, K] (float32/fp16/bf16), or one `QuantizedWeight` [E * N, K] whose rows are the experts' in
order (every format of kernels/qlinear.py, decoded by its `_decode_tile`). Dense half weights beside activations of
their dtype go to tl.dot as they are (exact products, float32 sums); otherwise tiles are float32 and the dot is
"ieee" for float32 activations, "tf32" for half ones (as in qlinear).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted
from kernels.qlinear import _check_int32, _decode_tile, fmt_code
from kernels.quant import QuantizedWeight

DENSE = -1


@triton.jit
def _tile(w_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, stride_wn, stride_sn, GROUP, FMT: tl.constexpr,
          PER_CHANNEL: tl.constexpr, NATIVE: tl.constexpr):
    """[BLOCK_N, BLOCK_K] of one expert's weight (rows offs_n < N, columns offs_k < K; 0 outside)."""
    if FMT == -1:
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
        if not NATIVE:
            w = w.to(tl.float32)
    else:
        w = _decode_tile(w_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, stride_wn, stride_sn, GROUP, FMT, PER_CHANNEL)
    return w


@triton.jit
def _row_scale(acc, s_ptr, offs_n, N, stride_sn, PER_CHANNEL: tl.constexpr):
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=offs_n < N, other=0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, m_ptr, act_ptr, sorted_ptr, expert_ptr, P, TOPK, I, H, stride_xm,
                    stride_we, stride_wn, stride_se, stride_sn, stride_am, GROUP, FMT: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    rows = (pair // TOPK).to(tl.int64)[:, None] * stride_xm
    live = (pair < P)[:, None]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_e, s_e, m_e = w_ptr + e * stride_we, s_ptr + e * stride_se, m_ptr + e * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows + offs_k[None, :], mask=live & (offs_k[None, :] < H), other=0)
        if not NATIVE:
            x = x.to(tl.float32)
        wg = _tile(w_e, s_e, m_e, offs_n, offs_k, I, H, stride_wn, stride_sn, GROUP, FMT, PER_CHANNEL, NATIVE)
        wu = _tile(w_e + I * stride_wn, s_e + I * stride_sn, m_e + I * stride_sn, offs_n, offs_k, I, H, stride_wn,
                   stride_sn, GROUP, FMT, PER_CHANNEL, NATIVE)
        gate = tl.dot(x, tl.trans(wg), gate, input_precision=PRECISION)
        up = tl.dot(x, tl.trans(wu), up, input_precision=PRECISION)
    gate = _row_scale(gate, s_e, offs_n, I, stride_sn, PER_CHANNEL)
    up = _row_scale(up, s_e + I * stride_sn, offs_n, I, stride_sn, PER_CHANNEL)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=(offs_n < I)[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, m_ptr, y_ptr, rw_ptr, sorted_ptr, expert_ptr, P, H, I, stride_am,
                 stride_we, stride_wn, stride_se, stride_sn, stride_ym, GROUP, FMT: tl.constexpr,
                 PER_CHANNEL: tl.constexpr, NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    live = pair < P
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_e, s_e, m_e = w_ptr + e * stride_we, s_ptr + e * stride_se, m_ptr + e * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :],
                    mask=(offs_k < I)[None, :], other=0)
        if not NATIVE:
            a = a.to(tl.float32)
        w = _tile(w_e, s_e, m_e, offs_n, offs_k, H, I, stride_wn, stride_sn, GROUP, FMT, PER_CHANNEL, NATIVE)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    acc = _row_scale(acc, s_e, offs_n, H, stride_sn, PER_CHANNEL)
    acc = acc * tl.load(rw_ptr + pair, mask=live, other=0)[:, None]
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc,
             mask=live[:, None] & (offs_n < H)[None, :])


# ---------------------------------------------------------------------------------------------------- host side
def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (t, j) of ids [T, k] grouped by expert, each expert's run padded to a multiple of block_m:
    (sorted int32 [blocks * block_m]: pair t * k + j, or T * k for padding; block_expert int32 [blocks]: the expert
    of each block, -1 past the used ones). blocks = P // block_m + min(E, P) bounds sum_e ceil(count_e / block_m)."""
    flat = ids.reshape(-1).long()
    p, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    grouped = flat[order]
    pos = (ends - padded)[grouped] + torch.arange(p, device=dev) - (counts.cumsum(0) - counts)[grouped]
    blocks = p // block_m + min(num_experts, p)
    sorted_ids = torch.full((blocks * block_m,), p, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    expert = torch.searchsorted(ends, torch.arange(blocks, device=dev) * block_m, right=True)
    return sorted_ids, torch.where(expert < num_experts, expert, -1).to(torch.int32)


def num_experts(w_gate_up: torch.Tensor | QuantizedWeight, w_down: torch.Tensor | QuantizedWeight) -> int:
    """E of the stacked weights (a QuantizedWeight stack is [E * N, K]: E = down's rows / gate_up's K = H)."""
    if isinstance(w_gate_up, torch.Tensor):
        return w_gate_up.shape[0]
    return w_down.out_features // w_gate_up.in_features


def _operands(w: torch.Tensor | QuantizedWeight, e: int) -> tuple:
    """(weight, scales, mins, stride_we, stride_wn, stride_se, stride_sn, group, FMT, PER_CHANNEL) of a stack."""
    if isinstance(w, torch.Tensor):
        if w.stride(-1) != 1:
            raise ValueError("the stacked expert weight must have unit stride along its last dimension")
        return w, w, w, w.stride(0), w.stride(1), 0, 0, 1, DENSE, False
    _check_int32(w)
    n = w.out_features // e
    mins = w.mins if w.mins is not None else w.scales
    return (w.qweight, w.scales, mins, n * w.qweight.stride(0), w.qweight.stride(0), n * w.scales.stride(0),
            w.scales.stride(0), w.group_size, fmt_code(w), w.num_groups == 1 and w.mins is None)


def launch_blocks(pairs: int, e: int, n: int, k: int, interpreted: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). Interpreted: the cost is per program instance, so big tiles. On a GPU:
    not timed (no GPU was available); BLOCK_M 16 while an expert gets a few rows (decode), else 64; tiles that
    compile without register spills on sm_80 and sm_90 for every format (ptxas -v, tests/kernels/cuda_compile_check.py;
    the gate_up kernel's two accumulators spilled at 16 x 64 x 64 and 64 x 64 x 64 with int4/ternary)."""
    if interpreted:
        bm = max(16, min(64, triton.next_power_of_2(-(-pairs // min(e, pairs)))))
        return bm, max(16, min(256, triton.next_power_of_2(n))), max(16, min(512, triton.next_power_of_2(k))), 4
    return (16, 32, 64, 4) if pairs < 32 * e else (64, 64, 32, 8)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor | QuantizedWeight, w_down: torch.Tensor | QuantizedWeight,
              weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] float32/fp16/bf16; w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I], dense or stacked
    QuantizedWeights; weights float32 [T, k]; ids [T, k] in [0, E). Returns [T, H] in x.dtype."""
    t, h = x.shape
    k = ids.shape[1]
    e = num_experts(w_gate_up, w_down)
    inter = w_down.shape[-1] if isinstance(w_down, torch.Tensor) else w_down.in_features
    if x.stride(-1) != 1:
        x = x.contiguous()
    if t == 0:
        return torch.zeros_like(x)
    pairs = t * k
    interp = is_interpreted(_gate_up_kernel)
    native = (not interp and x.dtype in (torch.float16, torch.bfloat16)
              and all(isinstance(w, torch.Tensor) and w.dtype == x.dtype for w in (w_gate_up, w_down)))
    prec = "ieee" if x.dtype == torch.float32 or interp else "tf32"
    bm, bn, bk, warps = launch_blocks(pairs, e, inter, h, interp)
    sorted_ids, block_expert = align_blocks(ids, e, bm)
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    gu, gs, gm, *gstr, ggroup, gfmt, gpc = _operands(w_gate_up, e)
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, bn))](
        x, gu, gs, gm, act, sorted_ids, block_expert, pairs, k, inter, h, x.stride(0), *gstr, act.stride(0), ggroup,
        FMT=gfmt, PER_CHANNEL=gpc, NATIVE=native, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=prec,
        num_warps=warps)
    _, bn, bk, _ = launch_blocks(pairs, e, h, inter, interp)
    y = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    dw, ds, dm, *dstr, dgroup, dfmt, dpc = _operands(w_down, e)
    _down_kernel[(block_expert.numel(), triton.cdiv(h, bn))](
        act, dw, ds, dm, y, weights.float().contiguous(), sorted_ids, block_expert, pairs, h, inter, act.stride(0),
        *dstr, y.stride(0), dgroup, FMT=dfmt, PER_CHANNEL=dpc, NATIVE=native, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=prec, num_warps=warps)
    return y.view(t, k, h).sum(1).to(x.dtype)
