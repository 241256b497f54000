"""The few-query attention path (decode and verification steps) against SDPA in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import grouped_attention


@pytest.mark.parametrize("hq, hkv, length, ctx", [(9, 3, 1, 600), (9, 3, 5, 600), (8, 8, 3, 70), (4, 1, 16, 16),
                                                  (32, 4, 2, 2)])
def test_grouped_attention_matches_sdpa(hq, hkv, length, ctx):
    g = torch.Generator().manual_seed(hq * 1000 + ctx)
    q, k, v = (torch.randn(h, n, 64, generator=g, dtype=torch.float64) for h, n in ((hq, length), (hkv, ctx), (hkv, ctx)))
    mask = torch.arange(ctx)[None, :] <= torch.arange(length)[:, None] + ctx - length
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    ours = grouped_attention(q.float(), k.float(), v.float(), None if length == 1 else mask, 0.125)
    assert ours.shape == (hq, length, 64)
    err = (ours.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err
