"""The attention layers' memory: each sequence's KV page table, prefix reuse and KV tiers.

A prompt's pages are reserved when it is admitted; decode pages are taken as the sequence grows.

With a prefix cache, admission first looks up the longest cached prefix of the sequence's tokens: those pages are
shared (read-only) and counted as computed, and only the rest is reserved. Then the cached page that shares the
longest token prefix with the next tokens (a partial "tail" page a finished sequence left, or a full page matching
only in part) is copied into the sequence's own next page, and those tokens count as computed too (at most
len(tokens) - 1 in all). A sequence that releases its pages leaves its partial last page as such a tail. Idle cached
pages count as available, so a request that fits the pool is never held back by cached prefixes: allocation evicts
them.

With KV tiers (engine/memory/kv/window.py), a sequence longer than the window (or every one, with ring on) runs windowed:
at admission, or when it outgrows the window while decoding, it takes its fixed GPU footprint and host pages for its
whole length, and from then on needs no more GPU pages. A windowed sequence admitted with a cached prefix (full pages
in the GPU prefix cache, continued in the host prefix store) starts from those pages (Tiering.open /
TieredPages.preload); when it ends, its written-through host pages go to the host prefix store, which exists
whenever tiers and prefix reuse are on (--kv-reuse-hostbacked also backs GPU cache evictions). Windowed sequences
neither share GPU pages nor leave tails: their GPU pages are a ring, rewritten. A windowed sequence reuses a prefix
only as deep as its steps then compute what a cold prefill's steps compute (Tiering.reuse_depth): what a windowed
step computes depends on where it starts.

`check_admissions` (tests): after every admission, the prefix cache's and the windowed table's invariants are
asserted (PrefixCache.check, TieredPages.check).

Pages are keyed by the sequence's key tokens (engine/memory/kv/prefix.py: key_tokens): its token ids, each image
placeholder read as an id from its image's content hash, so prompts with images share pages exactly as far as
their text and images agree.

`limit` (admission): a model with recurrent layers can resume only where a state snapshot exists, so the caller
says how many of the matched full pages are usable (engine/memory/state.py); partial copies and host-stored pages,
which no snapshot covers, are then not used."""
from __future__ import annotations

import logging
from typing import Callable

from engine.memory.kv.cache import KVCache
from engine.memory.kv.hostprefix import HostPrefixStore
from engine.memory.kv.pages import PagePool
from engine.memory.kv.prefix import PrefixCache, key_tokens
from engine.memory.kv.table import PageList
from engine.memory.kv.window import Tiering

log = logging.getLogger("ninfer.scheduler")

Limit = Callable[[list[bytes]], int]  # the chain keys of matched pages -> how many of them may be used


class AttentionMemory:
    check_admissions = False  # tests: assert the invariants after every admission (costs a recomputation)

    def __init__(self, pool: PagePool, prefix: PrefixCache | None = None, tiers: Tiering | None = None,
                 host_prefix: HostPrefixStore | None = None, kv: KVCache | None = None):
        """`host_prefix`: prefix pages evicted to the host come back from it; `kv`: the pool's KV tensors, for
        copies of partial pages (None: only full pages are reused)."""
        self.pool, self.prefix, self.tiers, self.kv = pool, prefix, tiers, kv
        if host_prefix is None and tiers is not None and prefix is not None:  # windowed sequences' pages
            host_prefix = HostPrefixStore.for_host(tiers.host, tiers.gpu)
        self.host_prefix = host_prefix
        self.counters = dict(prefix_hits=0, prefix_hit_tokens=0, prefix_prompt_tokens=0,
                             prefix_recompute_hit_tokens=0, prefix_partial_copies=0, prefix_partial_tokens=0,
                             prefix_windowed_hit_tokens=0)

    # ---- admission ----------------------------------------------------------------------------------------------
    def admit(self, seq, recompute: bool, limit: Limit | None = None) -> bool:
        """Gives the sequence its pages (cached prefix shared, the rest reserved); False when the pool is short.
        `recompute`: a re-admission after preemption (counted apart from new prompts)."""
        if self.tiers is not None and self.tiers.spec.windowed(len(seq.tokens) + 1):
            admitted = self._admit_windowed(seq, recompute, limit)
            if admitted and self.check_admissions:
                self.check(seq)
            return admitted
        tokens = key_tokens(seq)
        hits = self._match(tokens, limit)
        shared = [e.page for e in hits]
        need = self.pool.pages_for(len(seq.tokens) + 1) - len(shared)
        idle_hits = sum(1 for page in shared if self.pool.refcount(page) == 0)  # sharing them takes them off the LRU
        if need + idle_hits > self.pool.num_free:
            return False
        self.pool.share(shared)
        seq.pages = PageList(shared + self.pool.allocate(need), self.pool.page_size)  # may evict idle cached pages
        from_host = []
        if self.host_prefix is not None and self.prefix is not None and limit is None:
            cap = self.prefix.reusable_tokens(len(seq.tokens)) // self.pool.page_size
            from_host = self.host_prefix.match(tokens, len(shared), hits[-1].key if hits else b"", cap)
            if from_host:
                self.host_prefix.load(from_host, seq.pages[len(shared):len(shared) + len(from_host)])
        seq.num_computed = (len(shared) + len(from_host)) * self.pool.page_size
        copied = 0
        if self.prefix is not None and self.kv is not None and not from_host and limit is None:
            source, copied = self.prefix.match_partial(tokens, hits)
            if copied:  # copy on write: the cached page's KV into the sequence's own next page
                self.kv.copy_pages([source.page], [seq.pages[len(shared)]])
                seq.num_computed += copied
        if self.prefix is None:
            return True
        self.prefix.admitted(seq, hits)
        if self.check_admissions:
            self.check(seq)
        if copied:
            self.counters["prefix_partial_copies"] += 1
            self.counters["prefix_partial_tokens"] += copied
        self._count_hit(seq, recompute)
        if seq.num_computed:
            log.debug("prefix hit: %s reuses %d of %d tokens (%d cached pages, %d from the host, %d copied)%s",
                      seq.request_id, seq.num_computed, len(seq.tokens), len(hits), len(from_host), copied,
                      " after preemption" if recompute else "")
        return True

    def _match(self, tokens, limit: Limit | None) -> list:
        if self.prefix is None:
            return []
        hits = self.prefix.match(tokens)
        return hits if limit is None or not hits else hits[:limit([e.key for e in hits])]

    def _reserve_tokens(self, seq) -> int:
        """Tokens a windowed sequence can reach: its host pages are reserved for all of them up front."""
        return min(seq.max_context, len(seq.prompt) + seq.params.max_tokens)

    def _admit_windowed(self, seq, recompute: bool, limit: Limit | None) -> bool:
        tiers, reserve = self.tiers, self._reserve_tokens(seq)
        if not tiers.can_open(self.pool.num_free, 0, reserve):
            return False
        gpu_pages = self.pool.allocate(tiers.spec.footprint)  # may evict cached pages: look them up after this
        hits, stored = self._windowed_prefix(seq, limit)
        seq.pages = tiers.open(gpu_pages, reserve, 0, [e.page for e in hits], stored)
        if stored:
            self.host_prefix.hit(stored)
        seq.num_computed = (len(hits) + len(stored)) * self.pool.page_size
        if self.prefix is not None:
            self.counters["prefix_windowed_hit_tokens"] += seq.num_computed
            self._count_hit(seq, recompute)
        if seq.num_computed:
            log.debug("prefix hit: windowed %s reuses %d of %d tokens (%d cached pages, %d from the host)%s",
                      seq.request_id, seq.num_computed, len(seq.tokens), len(hits), len(stored),
                      " after preemption" if recompute else "")
        return True

    def _windowed_prefix(self, seq, limit: Limit | None) -> tuple[list, list[int]]:
        """The GPU prefix-cache entries and host prefix-store pages a windowed sequence starts from: its longest
        cached prefix, cut back to a depth where its steps compute what a cold prefill's compute
        (Tiering.reuse_depth) and, for recurrent layers, to a depth with a state snapshot."""
        if self.prefix is None or self.kv is None:
            return [], []
        tokens = key_tokens(seq)
        hits = self.prefix.match(tokens)
        stored = []
        if self.host_prefix is not None and limit is None:
            cap = self.prefix.reusable_tokens(len(tokens)) // self.pool.page_size
            stored = self.host_prefix.match(tokens, len(hits), hits[-1].key if hits else b"", cap)
        depth = self.tiers.reuse_depth(len(hits) + len(stored))
        while limit is not None and depth:  # as deep as a snapshot, at a depth reuse_depth allows
            usable = self.tiers.reuse_depth(limit([e.key for e in hits[:depth]]))
            if usable == depth:
                break
            depth = usable
        return hits[:depth], stored[:max(0, depth - len(hits))]

    def check(self, seq) -> None:
        """Asserts the invariants of the prefix cache and of the sequence's windowed table (for tests): a windowed
        sequence starts where the reuse rule allows (computed anew here), from a prefix that is exact."""
        if self.prefix is not None:
            self.prefix.check()
        if seq.pages.windowed:
            spec, depth = self.tiers.spec, seq.num_computed
            assert depth % spec.chunk == 0 or (depth - spec.window) // spec.page_size <= 1, \
                "a windowed reuse off a chunk boundary"
            assert seq.pages.exact == seq.num_computed
            seq.pages.check(self.tiers.gpu, seq.num_computed)

    def _count_hit(self, seq, recompute: bool) -> None:
        c = self.counters
        if recompute:
            c["prefix_recompute_hit_tokens"] += seq.num_computed
        else:
            c["prefix_prompt_tokens"] += len(seq.tokens)
            c["prefix_hit_tokens"] += seq.num_computed
            c["prefix_hits"] += bool(seq.num_computed)

    # ---- while running ----------------------------------------------------------------------------------------
    def grow(self, seq, num_tokens: int) -> bool:
        """Makes the sequence's table hold num_tokens (a plain sequence that outgrew the window becomes windowed);
        False, with nothing changed, when the pool is short."""
        if self.tiers is not None and not seq.pages.windowed and self.tiers.spec.windowed(len(seq.tokens)):
            return self._to_window(seq)
        return seq.pages.grow(self.pool, num_tokens)

    def _to_window(self, seq) -> bool:
        """A running plain sequence outgrew the window: it becomes windowed, keeping its computed pages (pages the
        prefix cache knows are copied, since a windowed sequence rewrites its pages)."""
        tiers, reserve = self.tiers, self._reserve_tokens(seq)
        cached = [i for i, p in enumerate(seq.pages) if self.prefix is not None and self.prefix.is_cached(p)]
        if not tiers.can_open(self.pool.num_free - len(cached), len(seq.pages), reserve):
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

    def computed(self, seq) -> None:
        """After a step advanced seq.num_computed: its newly full pages become reusable."""
        if self.prefix is not None:
            self.prefix.register(seq)

    def rollback(self, seq) -> None:
        """The sequence gave tokens back (rejected drafts): pages past its tokens are returned."""
        seq.pages.shrink(self.pool, len(seq.tokens))

    def release(self, seq) -> None:
        """All its pages back to the pool (a plain sequence's partial last page stays cached as a tail)."""
        if seq.pages.windowed:
            self.tiers.release(seq.pages, key_tokens(seq), self.host_prefix)
        elif self.prefix is not None and self.kv is not None and seq.pages:
            self.prefix.keep_tail(seq)  # its partial last page stays cached (idle) for copies
        self.pool.deallocate(seq.pages)
        seq.pages = PageList((), self.pool.page_size)
        if self.prefix is not None:
            self.prefix.forget(seq)

    def stats(self) -> dict:
        c = dict(self.counters)
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
