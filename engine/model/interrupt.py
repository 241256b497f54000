"""Interrupting a forward pass between layers: the rows of sequences whose abort was requested leave the batch, and the
remaining layers compute only the others.

A long prefill step (a 4K-token chunk on a loaded CPU takes seconds) would otherwise run to its end for a request
that is gone. The sequences that stay compute what they would have (each row's layers depend on its own sequence
only); a sequence that leaves is ended by the engine, which releases its memory: nothing of the step counts for it
(its computed length never advanced), KV written past that length is overwritten by whoever holds the pages next,
and its recurrent-state slot is zeroed when handed out again."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from engine.batch import ForwardBatch


class Interrupt:
    """Asked before every layer of a general forward (not a static decode step): `aborted()` names the sequences of
    the step (indices into its `seqs`, as the step began) that must stop now."""

    def __init__(self, aborted: Callable[[], list[int]]):
        self.aborted = aborted
        self.dropped: set[int] = set()  # indices of the sequences that left the step
        self._alive: list[int] | None = None  # indices of the sequences still in the batch, in order

    def cut(self, batch: ForwardBatch) -> tuple[ForwardBatch, torch.Tensor] | None:
        """None when every sequence stays; else the batch without the ones that leave, and the rows kept (indices
        into the batch as it was before this cut)."""
        if self._alive is None:
            self._alive = list(range(len(batch.seqs)))
        gone = set(self.aborted()) - self.dropped
        if not gone.intersection(self._alive):
            return None
        self.dropped |= gone
        keep = [k for k, i in enumerate(self._alive) if i not in gone]
        self._alive = [self._alive[k] for k in keep]
        return without(batch, keep)


def without(batch: ForwardBatch, keep: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
    """The batch of only the sequences `keep` (indices into batch.seqs), and the indices of their rows."""
    dev = batch.input_ids.device
    seqs, rows, logit_rows, q_start = [], [], [], 0
    wanted = None if batch.logit_rows is None else batch.logit_rows.tolist()
    for k in keep:
        s = batch.seqs[k]
        span = range(s.q_start, s.q_start + s.q_len)
        rows.extend(span)
        if wanted is not None:
            logit_rows.extend(q_start + r - s.q_start for r in wanted if r in span)
        seqs.append(dataclasses.replace(s, q_start=q_start))  # per-step tensors (masks) do not depend on q_start
        q_start += s.q_len
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    positions = batch.positions.index_select(0, index)
    return ForwardBatch(
        input_ids=batch.input_ids.index_select(0, index), positions=positions,
        slots=batch.slots.index_select(0, index), seqs=seqs, kv=batch.kv, state=batch.state,
        logit_rows=None if wanted is None else torch.tensor(logit_rows, dtype=torch.long, device=dev),
        max_position=int(positions.max()) if rows else 0,
        rope_positions=None if batch.rope_positions is None else batch.rope_positions.index_select(1, index)), index
