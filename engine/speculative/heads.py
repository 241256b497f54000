"""Output layers for drafting: the full one, or (`--lm-head-draft`) one cut to the most frequent tokens.

BPE vocabularies number tokens roughly by merge order, so the first ids are the most frequent ones; a draft that
scores only those reads a fraction of the output layer. Verification still uses the target's full output layer, so
the cut costs acceptance (a rarer token is never drafted), never correctness."""
from __future__ import annotations

import torch

from engine.model.linear import Linear
from kernels.quant import QuantizedWeight

LM_HEAD_DRAFT_FRACTION = 4  # the cut head keeps the first vocab / 4 tokens
LM_HEAD_DRAFT_MIN = 1024


def draft_head(head: Linear, cut: bool) -> Linear:
    if not cut:
        return head
    w = head.weight
    vocab = w.shape[0]
    n = min(vocab, max(LM_HEAD_DRAFT_MIN, vocab // LM_HEAD_DRAFT_FRACTION))
    bias = None if head.bias is None else head.bias[:n]
    if isinstance(w, QuantizedWeight):
        w = QuantizedWeight(w.format, w.qweight[:n].contiguous(), w.scales[:n].contiguous(),
                            None if w.mins is None else w.mins[:n].contiguous(), w.group_size, (n, w.shape[1]))
        return Linear(w, bias)
    return Linear(w[:n].contiguous(), bias)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row (ids of a cut head are the same as the full head's: it keeps the first rows)."""
    return logits.argmax(-1).tolist()
