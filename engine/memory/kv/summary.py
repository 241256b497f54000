"""Quest page summaries and top-k page selection.

A page's summary is, per KV head and per channel, the minimum and the maximum of its keys (the keys as stored:
after RoPE, and in the rotated basis for the rk* formats, so queries must be in the same basis). For a query q,
sum_i max(q_i * min_i, q_i * max_i) is an upper bound of q . k over every key k of the page; the pages with the
largest bounds are the ones attention could weigh most, and those are the ones brought back to the GPU.
"""
from __future__ import annotations

import torch

from kernels.dispatch import quest_bounds, use_triton


def page_summary(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n * page_size, Hkv, D] -> (min, max), each [n, Hkv, D] float32."""
    k = keys.float().view(-1, page_size, *keys.shape[1:])
    return k.amin(1), k.amax(1)


def page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The Quest bound of every page for every query row and head: q [T, Hq, D], kmin/kmax [N, Hkv, D] ->
    [N, T, Hkv, G], G = Hq / Hkv query heads per KV head (query head h reads KV head h // G)."""
    t, hq, d = q.shape
    hkv = kmin.shape[1]
    qg = q.float().view(t, hkv, hq // hkv, d)
    # max(q*min, q*max) per channel: where q >= 0 it is q*max, where q < 0 it is q*min
    return (torch.einsum("thgd,nhd->nthg", qg.clamp(min=0), kmax)
            + torch.einsum("thgd,nhd->nthg", qg.clamp(max=0), kmin))


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block: int = 256) -> torch.Tensor:
    """One score per page [N] for this step's queries.

    Per query row and head, a page's bound is taken relative to the mean bound over the candidate pages (softmax
    is shift-invariant within a head, and this removes the offset a query's norm adds to every page). A page's
    score is the largest over the step's rows (a chunk keeps a page any of its rows needs) and over every query
    head of every KV head (GQA-aware: a page is fetched for all heads at once).

    The bound is linear in (kmin, kmax) for a given query, so the mean bound is the bound of the mean summary, and
    pages are scored `block` at a time: memory stays [block, rows, heads] for long contexts and prefill chunks."""
    t, hq, d = q.shape
    hkv = kmin.shape[1]
    qg = q.float().view(t, hkv, hq // hkv, d)
    pos, neg = qg.clamp(min=0), qg.clamp(max=0)
    mean_max, mean_min = kmax.mean(0), kmin.mean(0)
    scores = []
    for i in range(0, kmin.shape[0], block):
        hi, lo = kmax[i:i + block] - mean_max, kmin[i:i + block] - mean_min
        if use_triton(q.device):  # kernels/quest.py
            bound = quest_bounds(q, lo, hi)
        else:
            bound = torch.einsum("thgd,nhd->nthg", pos, hi) + torch.einsum("thgd,nhd->nthg", neg, lo)
        scores.append(bound.amax(dim=(1, 2, 3)))
    return torch.cat(scores) if scores else kmin.new_zeros(0)


def select_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, k: int, mass: bool = False):
    """Indices (into kmin/kmax's N pages, ascending) of the k pages with the largest scores, and their scores; with
    `mass`, also the share of the bound mass left outside them (outside_share)."""
    n = kmin.shape[0]
    if k <= 0 or n == 0:
        return ([], [], 0.0) if mass else ([], [])
    scores = page_scores(q, kmin, kmax)
    top = torch.arange(n, device=scores.device) if k >= n else torch.topk(scores, k).indices.sort().values
    chosen = (top.tolist(), scores[top].tolist())
    return (*chosen, outside_share(scores, top, q.shape[-1])) if mass else chosen


def outside_share(scores: torch.Tensor, chosen: torch.Tensor, head_dim: int) -> float:
    """How unsure a selection is: the share of the candidates' bound mass outside the chosen pages. A page's
    score bounds (up to a shift common to all pages) the logit q.k / sqrt(head_dim) attention could give its keys,
    so exp(score / sqrt(head_dim)) bounds its share of the attention weight; 0 when the chosen pages hold all of
    it, near 1 when attention could mostly go to pages left on the host."""
    if chosen.numel() >= scores.numel():
        return 0.0
    weights = torch.softmax(scores.float() * head_dim ** -0.5, 0)
    return float(1.0 - weights[chosen].sum())
