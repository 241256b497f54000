"""The page pool: which KV pages are free, and which sequences hold which (a page may be held by several).

Each page has a reference count: the number of running sequences whose page table lists it. A page is written only
by the one sequence that allocated it, and only while it is that sequence's partial last page or beyond; once full
and computed it may be registered in a prefix cache (engine.memory.kv.prefix) and then shared read-only by later sequences.
A page whose count drops to zero goes back to the free list, unless the prefix cache keeps it: then it stays cached
(idle, evictable) until an allocation finds no free page and evicts it. A sequence's partial last page may be kept
that way too when it is released (a "tail"): it is never shared again, only copied into other sequences' own pages. Idle cached pages count as available
(``num_free``): a cache never makes an allocation fail.
"""
from __future__ import annotations

import heapq
from typing import Protocol

from engine.memory.kv.table import PageList


class PageCache(Protocol):
    """What the pool asks of a prefix cache (engine.memory.kv.prefix.PrefixCache)."""

    num_idle: int  # cached pages that no sequence holds (evictable)

    def released(self, page: int) -> bool: ...  # a page's count dropped to 0: True when the cache keeps it (idle)

    def pinned(self, page: int) -> None: ...  # an idle cached page is held again

    def evict(self) -> int: ...  # forget the least recently used idle cached page and hand it over


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        # a min-heap: the lowest free ids go first, so a sequence's pages tend to be consecutive ids, which the
        # CPU attention path reads as one view of the cache instead of gathering them (KVCache.gather)
        self._free: list[int] = list(range(num_pages))
        self._refs = [0] * num_pages
        self.cache: PageCache | None = None  # set by engine.memory.kv.prefix.PrefixCache when prefix reuse is on

    @property
    def num_free(self) -> int:
        """Pages an allocation can have now: free ones plus idle cached ones (which it would evict)."""
        return len(self._free) + self.num_cached

    @property
    def num_unused(self) -> int:
        """Pages holding nothing at all."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Idle cached pages: no sequence holds them, they keep a reusable prefix until evicted."""
        return self.cache.num_idle if self.cache is not None else 0

    @property
    def num_used(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_pages - self.num_free

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, num_pages: int) -> "PageList":
        """Fresh pages (count 1): free ones first, then idle cached pages, least recently used first; as a plain page
        table (engine.memory.kv.table.PageList)."""
        if num_pages > self.num_free:
            raise MemoryError(f"asked for {num_pages} KV pages, {self.num_free} free")
        pages = []
        for _ in range(num_pages):
            page = heapq.heappop(self._free) if self._free else self.cache.evict()
            assert self._refs[page] == 0, f"page {page} handed out while held"
            self._refs[page] = 1
            pages.append(page)
        return PageList(pages, self.page_size)

    def share(self, pages: list[int]) -> None:
        """Another holder for pages that are cached (held or idle): counts +1, idle ones stop being evictable."""
        for page in pages:
            if self._refs[page] == 0:
                self.cache.pinned(page)
            self._refs[page] += 1

    def deallocate(self, pages: list[int]) -> None:
        """Drops one holder of each page. Released last page first, so that a cached chain's tail is older in the
        cache's LRU than its head (evicted first)."""
        for page in reversed(pages):
            refs = self._refs[page] - 1
            if refs < 0:
                raise ValueError(f"KV page {page} released more often than it was held")
            self._refs[page] = refs
            if refs == 0 and not (self.cache is not None and self.cache.released(page)):
                heapq.heappush(self._free, page)

    def give_back(self, page: int) -> None:
        """A page the cache stopped keeping while no one holds it: free again."""
        assert self._refs[page] == 0
        heapq.heappush(self._free, page)
