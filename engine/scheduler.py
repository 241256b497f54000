"""Admission and batching: which sequences run this step, and how many of their tokens."""
from __future__ import annotations

import logging
from collections import deque

from engine.kv.cache import KVCache
from engine.kv.hostprefix import HostPrefixStore
from engine.kv.pages import PagePool
from engine.kv.prefix import PrefixCache
from engine.kv.window import TieredPages, Tiering
from engine.sequence import Sequence, Status

log = logging.getLogger("ninfer.scheduler")


class Scheduler:
    """First come, first served. Each step decodes every running sequence (one token each) and spends up to
    `prefill_chunk` tokens on prompts. A prompt's pages are reserved when it is admitted; decode pages are taken as
    sequences grow, and when the pool runs dry the most recently admitted sequence is preempted (its pages freed,
    its tokens recomputed later).

    With a prefix cache, admission first looks up the longest cached prefix of the sequence's tokens: those pages
    are shared (read-only) and counted as computed, and only the rest is reserved. Then the cached page that shares
    the longest token prefix with the next tokens (a partial "tail" page a finished sequence left, or a full page
    matching only in part) is copied into the sequence's own next page, and those tokens count as computed too (at
    most len(tokens) - 1 in all). A sequence that releases its pages leaves its partial last page as such a tail.
    Idle cached pages count as available, so a request that fits the pool is never held back by cached prefixes:
    allocation evicts them.

    With KV tiers (engine/kv/window.py), a sequence longer than the window (or every one, with ring on) runs
    windowed: at admission, or when it outgrows the window while decoding, it takes its fixed GPU footprint and
    host pages for its whole length, and from then on needs no more GPU pages. A windowed sequence admitted with a
    cached prefix (full pages in the GPU prefix cache, continued in the host prefix store) starts from those pages
    (Tiering.open / TieredPages.preload); when it ends, its written-through host pages go to the host prefix store,
    which exists whenever tiers and prefix reuse are on (--kv-reuse-hostbacked also backs GPU cache evictions).
    Windowed sequences neither share GPU pages nor leave tails: their GPU pages are a ring, rewritten."""

    def __init__(self, pool: PagePool, max_concurrency: int, prefill_chunk: int, prefix: PrefixCache | None = None,
                 tiers: Tiering | None = None, host_prefix=None, kv: KVCache | None = None):
        """`host_prefix`: an engine.kv.hostprefix.HostPrefixStore (prefix pages evicted to the host come back);
        `kv`: the pool's KV tensors, for copies of partial pages (None: only full pages are reused)."""
        self.pool = pool
        self.kv = kv
        self.tiers = tiers
        if host_prefix is None and tiers is not None and prefix is not None:  # windowed sequences' pages
            host_prefix = HostPrefixStore.for_host(tiers.host, tiers.gpu)
        self.host_prefix = host_prefix
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._readmit: dict[int, Sequence] = {}  # id -> preempted sequence: its next admission is a recompute
        self.prefix_counters = dict(prefix_hits=0, prefix_hit_tokens=0, prefix_prompt_tokens=0,
                                    prefix_recompute_hit_tokens=0, prefix_partial_copies=0,
                                    prefix_partial_tokens=0, prefix_windowed_hit_tokens=0)

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
        self._release(seq)
        self._readmit.pop(id(seq), None)
        if self.prefix is not None:
            self.prefix.forget(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        if self.prefix is not None:
            self.prefix.forget(seq)
        seq.num_computed, seq.status = 0, Status.WAITING
        self._readmit[id(seq)] = seq
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _release(self, seq: Sequence) -> None:
        if isinstance(seq.pages, TieredPages):
            self.tiers.release(seq.pages, seq.tokens, self.host_prefix)
        elif self.prefix is not None and self.kv is not None and seq.pages:
            self.prefix.keep_tail(seq)  # its partial last page stays cached (idle) for copies
        self.pool.deallocate(seq.pages)
        seq.pages = []

    def _reserve_tokens(self, seq: Sequence) -> int:
        """Tokens a windowed sequence can reach: its host pages are reserved for all of them up front."""
        return min(seq.max_context, len(seq.prompt) + seq.params.max_tokens)

    def _admit_windowed(self, seq: Sequence) -> bool:
        tiers, reserve = self.tiers, self._reserve_tokens(seq)
        if not tiers.can_open(self.pool.num_free, 0, reserve):
            return False
        gpu_pages = self.pool.allocate(tiers.spec.footprint)  # may evict cached pages: look them up after this
        hits, stored = [], []
        if self.prefix is not None and self.kv is not None:
            hits = self.prefix.match(seq.tokens)
            if self.host_prefix is not None:
                cap = self.prefix.reusable_tokens(len(seq.tokens)) // self.pool.page_size
                stored = self.host_prefix.match(seq.tokens, len(hits), hits[-1].key if hits else b"", cap)
        seq.pages = tiers.open(gpu_pages, reserve, 0, [e.page for e in hits], stored)
        if stored:
            self.host_prefix.hit(stored)
        seq.num_computed = (len(hits) + len(stored)) * self.pool.page_size
        recompute = self._readmit.pop(id(seq), None) is seq
        if self.prefix is not None:
            self.prefix_counters["prefix_windowed_hit_tokens"] += seq.num_computed
            self._count_hit(seq, recompute)
        if seq.num_computed:
            log.debug("prefix hit: windowed %s reuses %d of %d tokens (%d cached pages, %d from the host)%s",
                      seq.request_id, seq.num_computed, len(seq.tokens), len(hits), len(stored),
                      " after preemption" if recompute else "")
        return True

    def _to_window(self, seq: Sequence) -> bool:
        """A running plain sequence outgrew the window: it becomes windowed, keeping its computed pages (pages the
        prefix cache knows are copied, since a windowed sequence rewrites its pages). False when it was preempted."""
        tiers, reserve = self.tiers, self._reserve_tokens(seq)
        cached = [i for i, p in enumerate(seq.pages) if self.prefix is not None and self.prefix.is_cached(p)]
        while not tiers.can_open(self.pool.num_free - len(cached), len(seq.pages), reserve):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if self.prefix is not None:
            self.prefix.forget(seq)
        fresh = self.pool.allocate(tiers.spec.footprint - len(seq.pages) + len(cached))
        if cached:
            old = [seq.pages[i] for i in cached]
            tiers.gpu.copy_pages(old, fresh[:len(cached)])
            for i, page in zip(cached, fresh):
                seq.pages[i] = page
            self.pool.deallocate(old)
            fresh = fresh[len(cached):]
        seq.pages = tiers.open(seq.pages + fresh, reserve, seq.num_computed)
        log.debug("%s outgrew the KV window at %d tokens: windowed", seq.request_id, len(seq.tokens))
        return True

    def computed(self, seq: Sequence) -> None:
        """Called after a step advanced seq.num_computed: its newly full pages become reusable."""
        if self.prefix is not None and seq.status is Status.RUNNING:
            self.prefix.register(seq)

    def prefix_stats(self) -> dict:
        c = dict(self.prefix_counters)
        c["prefix_hit_ratio"] = c["prefix_hit_tokens"] / c["prefix_prompt_tokens"] if c["prefix_prompt_tokens"] else 0.0
        cache = self.prefix
        c.update(prefix_cached_pages=cache.num_pages if cache else 0, prefix_chains=cache.num_chains if cache else 0,
                 prefix_tail_pages=cache.num_tails if cache else 0,
                 prefix_evicted_pages=cache.evicted_pages if cache else 0,
                 max_shared_prefixes=cache.max_chains if cache else 0)
        store = self.host_prefix
        c.update(store.counters if store else dict(prefix_host_stored_pages=0, prefix_host_hits=0,
                                                   prefix_host_hit_tokens=0),
                 prefix_host_pages=store.num_pages if store else 0)
        return c

    def _admit(self, seq: Sequence) -> bool:
        """Gives the sequence its pages (cached prefix shared, the rest reserved); False when the pool is short."""
        if self.tiers is not None and self.tiers.spec.windowed(len(seq.tokens) + 1):
            return self._admit_windowed(seq)
        hits = self.prefix.match(seq.tokens) if self.prefix is not None else []
        shared = [e.page for e in hits]
        need = self.pool.pages_for(len(seq.tokens) + 1) - len(shared)
        idle_hits = sum(1 for page in shared if self.pool.refcount(page) == 0)  # sharing them takes them off the LRU
        if need + idle_hits > self.pool.num_free:
            return False
        self.pool.share(shared)
        seq.pages = shared + self.pool.allocate(need)  # may evict idle cached pages (to the host store)
        from_host = []
        if self.host_prefix is not None and self.prefix is not None:
            cap = self.prefix.reusable_tokens(len(seq.tokens)) // self.pool.page_size
            from_host = self.host_prefix.match(seq.tokens, len(shared), hits[-1].key if hits else b"", cap)
            if from_host:
                self.host_prefix.load(from_host, seq.pages[len(shared):len(shared) + len(from_host)])
        seq.num_computed = (len(shared) + len(from_host)) * self.pool.page_size
        copied = 0
        if self.prefix is not None and self.kv is not None and not from_host:
            source, copied = self.prefix.match_partial(seq.tokens, hits)
            if copied:  # copy on write: the cached page's KV into the sequence's own next page
                self.kv.copy_pages([source.page], [seq.pages[len(shared)]])
                seq.num_computed += copied
        recompute = self._readmit.pop(id(seq), None) is seq
        if self.prefix is None:
            return True
        self.prefix.admitted(seq, hits)
        if copied:
            self.prefix_counters["prefix_partial_copies"] += 1
            self.prefix_counters["prefix_partial_tokens"] += copied
        self._count_hit(seq, recompute)
        if seq.num_computed:
            log.debug("prefix hit: %s reuses %d of %d tokens (%d cached pages, %d from the host, %d copied)%s",
                      seq.request_id, seq.num_computed, len(seq.tokens), len(hits), len(from_host), copied,
                      " after preemption" if recompute else "")
        return True

    def _count_hit(self, seq: Sequence, recompute: bool) -> None:
        """Prefix counters of an admission: a re-admission after preemption counts apart from new prompts."""
        c = self.prefix_counters
        if recompute:
            c["prefix_recompute_hit_tokens"] += seq.num_computed
        else:
            c["prefix_prompt_tokens"] += len(seq.tokens)
            c["prefix_hit_tokens"] += seq.num_computed
            c["prefix_hits"] += bool(seq.num_computed)

    def schedule(self) -> list[tuple[Sequence, int]]:
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.to_compute != 1:
                continue
            if not isinstance(seq.pages, TieredPages) and self.tiers is not None \
                    and self.tiers.spec.windowed(len(seq.tokens)) and not self._to_window(seq):
                continue
            if isinstance(seq.pages, TieredPages):  # its footprint covers every step
                plan.append((seq, 1))
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
