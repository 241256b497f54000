"""Admission and batching: which sequences run this step, and how many of their tokens."""
from __future__ import annotations

import logging
from collections import deque

from engine.kv.pages import PagePool
from engine.kv.prefix import PrefixCache
from engine.sequence import Sequence, Status

log = logging.getLogger("ninfer.scheduler")


class Scheduler:
    """First come, first served. Each step decodes every running sequence (one token each) and spends up to
    `prefill_chunk` tokens on prompts. A prompt's pages are reserved when it is admitted; decode pages are taken as
    sequences grow, and when the pool runs dry the most recently admitted sequence is preempted (its pages freed,
    its tokens recomputed later).

    With a prefix cache, admission first looks up the longest cached prefix of the sequence's tokens: those pages
    are shared (read-only) and counted as computed, and only the rest is reserved. Idle cached pages count as
    available, so a request that fits the pool is never held back by cached prefixes: allocation evicts them."""

    def __init__(self, pool: PagePool, max_concurrency: int, prefill_chunk: int, prefix: PrefixCache | None = None):
        self.pool = pool
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._readmit: dict[int, Sequence] = {}  # id -> preempted sequence: its next admission is a recompute
        self.prefix_counters = dict(prefix_hits=0, prefix_hit_tokens=0, prefix_prompt_tokens=0,
                                    prefix_recompute_hit_tokens=0)

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
        self._readmit.pop(id(seq), None)
        if self.prefix is not None:
            self.prefix.forget(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.deallocate(seq.pages)
        if self.prefix is not None:
            self.prefix.forget(seq)
        seq.pages, seq.num_computed, seq.status = [], 0, Status.WAITING
        self._readmit[id(seq)] = seq
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def computed(self, seq: Sequence) -> None:
        """Called after a step advanced seq.num_computed: its newly full pages become reusable."""
        if self.prefix is not None and seq.status is Status.RUNNING:
            self.prefix.register(seq)

    def prefix_stats(self) -> dict:
        c = dict(self.prefix_counters)
        c["prefix_hit_ratio"] = c["prefix_hit_tokens"] / c["prefix_prompt_tokens"] if c["prefix_prompt_tokens"] else 0.0
        cache = self.prefix
        c.update(prefix_cached_pages=cache.num_pages if cache else 0, prefix_chains=cache.num_chains if cache else 0,
                 prefix_evicted_pages=cache.evicted_pages if cache else 0,
                 max_shared_prefixes=cache.max_chains if cache else 0)
        return c

    def _admit(self, seq: Sequence) -> bool:
        """Gives the sequence its pages (cached prefix shared, the rest reserved); False when the pool is short."""
        hits = self.prefix.match(seq.tokens) if self.prefix is not None else []
        shared = [e.page for e in hits]
        need = self.pool.pages_for(len(seq.tokens) + 1) - len(shared)
        idle_hits = sum(1 for page in shared if self.pool.refcount(page) == 0)  # sharing them takes them off the LRU
        if need + idle_hits > self.pool.num_free:
            return False
        self.pool.share(shared)
        seq.pages = shared + self.pool.allocate(need)
        seq.num_computed = len(shared) * self.pool.page_size
        recompute = self._readmit.pop(id(seq), None) is seq
        if self.prefix is None:
            return True
        self.prefix.admitted(seq, hits)
        c = self.prefix_counters
        if recompute:
            c["prefix_recompute_hit_tokens"] += seq.num_computed
        else:
            c["prefix_prompt_tokens"] += len(seq.tokens)
            c["prefix_hit_tokens"] += seq.num_computed
            c["prefix_hits"] += bool(hits)
        if hits:
            log.debug("prefix hit: %s reuses %d of %d tokens (%d cached pages)%s", seq.request_id, seq.num_computed,
                      len(seq.tokens), len(hits), " after preemption" if recompute else "")
        return True

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
            if not self._admit(seq):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.to_compute, budget)
            plan.append((seq, n))
            budget -= n
        return plan
