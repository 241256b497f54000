"""``ninfer-eval kld --url``: a server's next-token distributions against the in-process reference, from the top-k
logprobs an OpenAI-compatible server returns (it never sends the full vocabulary).

For each scored position i of a segment, the server is asked for one greedy token after the segment's first i+1
tokens (sent as token ids, so both sides read the same tokens) with ``logprobs=k``; the reference's full
distribution P at that position comes from the engine in process (kld.py's reference). What is computed:

- **KLD (lower bound).** The vocabulary is split by token text (ids whose text is the same form one bucket). The
  server's k texts are k buckets and all other tokens one "rest" bucket. KL(P || Q) is computed over these k+1
  outcomes: P's mass on each bucket against the server's reported probability, the rest being 1 minus the sum
  (at least 1e-10). Merging outcomes never increases a KL divergence (the log-sum inequality), so the value is a
  lower bound of the full-vocabulary KL; what it misses is the divergence inside the rest bucket.
- **Top-1 agreement.** The server's most likely text is the reference's most likely token's text.
- **Perplexity (lower bound).** The text's next token's probability is the server's when its text is in the top k,
  else the rest mass (an upper bound of it); the share of positions where it was in the top k is reported.

Both sides must share the tokenizer: a text the reference's vocabulary does not have is refused. A server that
reports only one id of a text that several ids share (a partial UTF-8 character) under-reports that bucket."""
from __future__ import annotations

import math
from typing import Any

import torch

from engine.errors import NInferError

REST_FLOOR = 1e-10


def text_buckets(tokenizer) -> dict[str, list[int]]:
    """Token text -> the ids with that text, over the whole vocabulary."""
    buckets: dict[str, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        buckets.setdefault(tokenizer.token_text(i), []).append(i)
    return buckets


def bounded_position(ref_logits: torch.Tensor, top: list[tuple[str, float]], next_id: int,
                     buckets: dict[str, list[int]], id_text: list[str]) -> dict[str, Any]:
    """KL lower bound, top-1 agreement and next-token NLL (lower bound) at one position; ``top`` is the server's
    (text, logprob) list and ``ref_logits`` the reference's logits [V] there."""
    logp = torch.log_softmax(ref_logits.double(), -1)
    p = logp.exp()
    merged: dict[str, float] = {}
    for text, lp in top:
        if text not in buckets:
            raise NInferError(f"The server returned the token {text!r}, which the reference's vocabulary does not "
                              f"have: the two do not share a tokenizer.", "Serve the same model (the same GGUF or "
                              "folder) that the reference loads, or give --ref that model.")
        merged[text] = merged.get(text, 0.0) + math.exp(lp)
    kl, p_seen, q_seen = 0.0, 0.0, 0.0
    for text, q in merged.items():
        pb = float(p[buckets[text]].sum())
        p_seen, q_seen = p_seen + pb, q_seen + q
        if pb > 0:
            kl += pb * math.log(pb / max(q, REST_FLOOR))
    p_rest, q_rest = max(0.0, 1.0 - p_seen), max(REST_FLOOR, 1.0 - q_seen)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    best = max(top, key=lambda t: t[1])[0] if top else None
    next_text = id_text[next_id]
    in_top = next_text in merged
    return {"kl": max(0.0, kl), "same": best == id_text[int(logp.argmax())],
            "nll_ref": -float(logp[next_id]), "nll_cand": -math.log(merged[next_text] if in_top else q_rest),
            "in_top": in_top}


def score_segment(remote, ref_logits: torch.Tensor, ids: list[int], k: int, stride: int,
                  buckets: dict[str, list[int]], id_text: list[str]) -> dict[str, Any]:
    """One segment's record for the results file: every ``stride``-th position but the last."""
    rows = [bounded_position(ref_logits[i], remote.next_token_top(ids[:i + 1], k), ids[i + 1], buckets, id_text)
            for i in range(0, len(ids) - 1, stride)]
    return {"positions": len(rows), "kl": [r["kl"] for r in rows], "top1_same": sum(r["same"] for r in rows),
            "nll_ref": sum(r["nll_ref"] for r in rows), "nll_cand": sum(r["nll_cand"] for r in rows),
            "next_in_top": sum(r["in_top"] for r in rows)}
