"""Admission and batching: which sequences run this step, and how many of their tokens."""
from __future__ import annotations

import logging
from collections import deque

from engine.memory.manager import MemoryManager
from engine.sequence import Sequence, Status

log = logging.getLogger("ninfer.scheduler")


class Scheduler:
    """First come, first served. Each step decodes every running sequence (one token each) and spends up to
    `prefill_chunk` tokens on prompts. Memory is the MemoryManager's business (engine/memory/): a sequence is
    admitted when it fits (a cached prefix may count as computed), grows as it decodes, and when memory runs short
    the most recently admitted sequence is preempted (its memory released, its tokens recomputed later).

    A windowed sequence (KV tiers) computes its prompt in whole chunks that start at multiples of `prefill_chunk`,
    or nothing in a step whose remaining budget is shorter: what a windowed step computes depends on where it
    starts, so this makes a prompt compute the same KV however the budget is shared and wherever a reused prefix
    ends (engine/memory/kv/window.py: Tiering.reuse_depth)."""

    def __init__(self, memory: MemoryManager, max_concurrency: int, prefill_chunk: int):
        self.memory = memory
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._readmit: dict[int, Sequence] = {}  # id -> preempted sequence: its next admission is a recompute

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in [*self.running, *self.waiting] if s.request_id == request_id), None)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence in any state and returns its memory at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.memory.release(seq)
        self._readmit.pop(id(seq), None)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.memory.release(seq)
        seq.num_computed, seq.status = 0, Status.WAITING
        self._readmit[id(seq)] = seq
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def computed(self, seq: Sequence) -> None:
        """Called after a step advanced seq.num_computed."""
        if seq.status is Status.RUNNING:
            self.memory.computed(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.to_compute != 1:
                continue
            while not self.memory.grow(seq, len(seq.tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                plan.append((seq, 1))
        budget = self.prefill_chunk
        for seq in self.running:
            if budget > 0 and seq.to_compute > 1:
                n = self._prefill_tokens(seq, budget)
                if n:
                    plan.append((seq, n))
                    budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_concurrency:
            seq = self.waiting[0]
            recompute = self._readmit.get(id(seq)) is seq
            if not self.memory.admit(seq, recompute=recompute):
                break
            if not recompute:
                seq.cached_tokens = seq.num_computed
            self._readmit.pop(id(seq), None)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = self._prefill_tokens(seq, budget)
            if n:
                plan.append((seq, n))
                budget -= n
        return plan

    def _prefill_tokens(self, seq: Sequence, budget: int) -> int:
        """Prompt tokens the sequence computes this step, out of `budget` (0: none this step)."""
        if not seq.pages.windowed:
            return min(seq.to_compute, budget)
        n = min(seq.to_compute, self.prefill_chunk - seq.num_computed % self.prefill_chunk)
        return n if n <= budget else 0
