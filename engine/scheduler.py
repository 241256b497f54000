"""Admission and batching: which sequences run this step, and how many of their tokens."""
from __future__ import annotations

from collections import deque

from engine.kv.pages import PagePool
from engine.sequence import Sequence, Status


class Scheduler:
    """First come, first served. Each step decodes every running sequence (one token each) and spends up to
    `prefill_chunk` tokens on prompts. A prompt's pages are reserved when it is admitted; decode pages are taken as
    sequences grow, and when the pool runs dry the most recently admitted sequence is preempted (its pages freed,
    its tokens recomputed later)."""

    def __init__(self, pool: PagePool, max_concurrency: int, prefill_chunk: int):
        self.pool = pool
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in [*self.running, *self.waiting] if s.request_id == request_id), None)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence in any state and returns its pages to the pool at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.deallocate(seq.pages)
        seq.pages = []
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.deallocate(seq.pages)
        seq.pages, seq.num_computed, seq.status = [], 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.to_compute != 1:
                continue
            while not self.pool.grow_to(seq.pages, len(seq.tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                plan.append((seq, 1))
        budget = self.prefill_chunk
        for seq in self.running:
            if budget > 0 and seq.to_compute > 1:
                n = min(seq.to_compute, budget)
                plan.append((seq, n))
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_concurrency:
            seq = self.waiting[0]
            need = self.pool.pages_for(len(seq.tokens) + 1)
            if not self.pool.can_allocate(need):
                break
            self.waiting.popleft()
            seq.pages = self.pool.allocate(need)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.to_compute, budget)
            plan.append((seq, n))
            budget -= n
        return plan
