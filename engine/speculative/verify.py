"""Verification: which drafted tokens the target model keeps, so that the output is exactly what it would have
produced without speculation.

Drafts are single proposals (a point mass q = 1 at the drafted token d), so speculative sampling reduces to: accept
d with probability p(d); on rejection draw from p with d removed (the residual max(0, p - q), renormalized). Every
emitted token is then distributed exactly as p. Greedy decoding accepts d when it is the argmax."""
from __future__ import annotations

import torch

from engine.sampling import SamplingParams, target_distribution


def verify(rows: torch.Tensor, drafts: list[int], params: SamplingParams, prompt: list[int], output: list[int],
           generator: torch.Generator, constraint=None) -> list[tuple[int, torch.Tensor]]:
    """rows: the target's logits [len(drafts) + 1, V] at the last token and at each draft. Returns the emitted
    tokens, each with its row's log-probabilities (or raw logits when the request wants no logprobs): the accepted
    drafts, then one token the target chose itself (a correction, or a bonus when every draft was accepted).
    A constraint (engine.constrain) masks each row and is advanced by each emitted token; the tokens end where its
    grammar is complete."""
    emitted: list[tuple[int, torch.Tensor]] = []
    history = list(output)
    for j, row in enumerate(rows):
        raw = row
        if constraint is not None:
            row = constraint.apply(row)
        target = target_distribution(row, params, prompt, history)
        logprobs = torch.log_softmax(raw.float(), -1) if params.logprobs is not None else raw
        draft = drafts[j] if j < len(drafts) else None
        token = _choose(target, draft, params.greedy, generator)
        emitted.append((token, logprobs))
        history.append(token)
        if constraint is not None:
            constraint.accept(token)
            if constraint.finished:  # the grammar is complete: nothing may follow
                break
        if token != draft:
            break
    return emitted


def _choose(target: torch.Tensor, draft: int | None, greedy: bool, generator: torch.Generator) -> int:
    if greedy:
        return int(torch.argmax(target))
    probs = target.cpu()
    if draft is not None:
        if float(torch.rand((), generator=generator)) < float(probs[draft]):
            return draft
        probs = probs.clone()
        probs[draft] = 0.0
        if float(probs.sum()) <= 0.0:  # p(draft) was 1 up to rounding: nothing else can be drawn
            return draft
    return int(torch.multinomial(probs, 1, generator=generator))
