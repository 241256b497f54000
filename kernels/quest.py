"""Triton: Quest page bounds, the upper bound of q . k over every key of a page from its per-channel key minimum and
maximum: sum_i max(q_i * min_i, q_i * max_i) = max(q, 0) . max + min(q, 0) . min.

Twin: `kernels.reference.quest_bounds_ref` (engine/memory/kv/summary.py uses the same formula to pick pages to retrieve).
Layout: q [T, Hq, D], kmin/kmax [N, Hkv, D] -> [N, T, Hkv, G], G = Hq / Hkv (query head h reads KV head h // G).
One program per (block of BLOCK_N pages, KV head, query row): a multiply-reduce over D in float32 (few registers;
a page's summary is re-read per query row, from cache: T * G is small for decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreted


@triton.jit
def _quest_kernel(q_ptr, kmin_ptr, kmax_ptr, out_ptr, N, D, stride_qh, stride_qr, stride_kn, stride_kh,
                  stride_on, stride_oh, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        q = tl.load(q_ptr + h * stride_qh + r * stride_qr + d, mask=d < D, other=0.0).to(tl.float32)
        kmask = (offs_n[:, None] < N) & (d[None, :] < D)
        koff = offs_n[:, None].to(tl.int64) * stride_kn + h * stride_kh + d[None, :]
        kmax = tl.load(kmax_ptr + koff, mask=kmask, other=0.0).to(tl.float32)
        kmin = tl.load(kmin_ptr + koff, mask=kmask, other=0.0).to(tl.float32)
        acc += tl.sum(kmax * tl.maximum(q, 0.0)[None, :] + kmin * tl.minimum(q, 0.0)[None, :], axis=1)
    tl.store(out_ptr + offs_n.to(tl.int64) * stride_on + h * stride_oh + r, acc, mask=offs_n < N)


def quest_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    T, Hq, D = q.shape
    N, Hkv, _ = kmin.shape
    G = Hq // Hkv
    R = T * G
    qr = q.float().view(T, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, R, D).contiguous()  # rows (t, g)
    kmin, kmax = kmin.float().contiguous(), kmax.float().contiguous()
    out = torch.empty(N, Hkv, R, dtype=torch.float32, device=q.device)
    if N:
        block_n = N if is_interpreted(_quest_kernel) else block_n  # the interpreter pays per program
        _quest_kernel[(triton.cdiv(N, block_n), Hkv, R)](
            qr, kmin, kmax, out, N, D, qr.stride(0), qr.stride(1), kmin.stride(0), kmin.stride(1),
            out.stride(0), out.stride(1), BLOCK_N=triton.next_power_of_2(block_n),
            BLOCK_D=min(64, triton.next_power_of_2(D)), num_warps=4)
    return out.view(N, Hkv, T, G).permute(0, 2, 1, 3)
