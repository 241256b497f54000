"""What one forward pass computes: a flat run of tokens from several sequences, and where their KV lives."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqSlice:
    q_start: int  # first row of this sequence in the flat token batch
    q_len: int  # tokens of this sequence computed in this step
    ctx_len: int  # tokens in its KV after this step (earlier context + q_len)
    pages: torch.Tensor | None  # page ids covering ctx_len tokens, in order (None for a windowed sequence)
    tiers: "object | None" = None  # engine.kv.window.TieredPages of a windowed sequence, prepared for this step

    def causal_mask(self, device) -> torch.Tensor:
        """[q_len, ctx_len] bool: token i of this step sees the earlier context and tokens up to itself."""
        offset = self.ctx_len - self.q_len
        rows = torch.arange(self.q_len, device=device).unsqueeze(1) + offset
        return torch.arange(self.ctx_len, device=device).unsqueeze(0) <= rows


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat KV slot (page * page_size + offset) each token's K/V is written to
    seqs: list[SeqSlice]
    kv: "object"  # engine.kv.cache.KVCache
    logit_rows: torch.Tensor | None = None  # rows to compute logits for; None = every row
    max_position: int = 0
