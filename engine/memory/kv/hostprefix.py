"""Host-backed prefix reuse (--kv-reuse-hostbacked): cached prefix pages evicted from the GPU keep a copy in the
host tier, and come back on a hit instead of being computed again.

The store is the host page pool's cache (the PageCache protocol of engine/memory/kv/pages.py): its pages are idle, count as
free, and an allocation of host pages (a windowed sequence reserving its pages) evicts the least recently used ones
first. So a stored prefix never takes host memory a sequence needs. Entries are keyed like the GPU prefix cache
(engine/memory/kv/prefix.py: a hash chained over the tokens of every page up to this one) and also keep their page's tokens
and their parent's key, which a hit compares: a hash collision can only cost a miss.

Windowed sequences (engine/memory/kv/window.py) keep every full page on the host anyway: when one ends, its written-through
pages whose KV a cold prefill of the same tokens computes alike (TieredPages.exact_pages) become stored pages as they
are (``keep``, no copy), and a later windowed sequence with the same prefix takes them over as its own host pages (``PagePool.share`` -> ``pinned``: the store forgets them until that sequence ends
and gives them back). Only full pages are stored: partial pages (GPU prefix-cache tails) are dropped on eviction.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.memory.kv.cache import KVCache
from engine.memory.kv.host import HostPool
from engine.memory.kv.prefix import Entry, page_key

log = logging.getLogger("ninfer.prefix")


@dataclass(eq=False)
class _Stored:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    page: int  # host page


class HostPrefixStore:
    @classmethod
    def for_host(cls, host: HostPool, gpu: KVCache) -> "HostPrefixStore":
        """The host pool's store (kept across engines over the same runner, like the GPU prefix cache)."""
        return host.pool.cache if isinstance(host.pool.cache, cls) else cls(host, gpu)

    def __init__(self, host: HostPool, gpu: KVCache):
        if host.pool.cache is not None:
            raise ValueError("this host pool already has a prefix store")
        self.host, self.gpu = host, gpu
        self.pool = host.pool
        self._by_key: dict[bytes, _Stored] = {}
        self._lru: OrderedDict[int, _Stored] = OrderedDict()  # host page -> entry, least recently used first
        self.counters = dict(prefix_host_stored_pages=0, prefix_host_hits=0, prefix_host_hit_tokens=0)
        host.pool.cache = self

    # ---- the PageCache protocol of the host pool -------------------------------------------------------------
    @property
    def num_idle(self) -> int:
        return len(self._lru)

    def released(self, page: int) -> bool:
        return page in self._lru

    def pinned(self, page: int) -> None:
        """A windowed sequence takes a stored page over as one of its own host pages: the store forgets it."""
        entry = self._lru.pop(page)
        del self._by_key[entry.key]

    def evict(self) -> int:
        page, entry = self._lru.popitem(last=False)
        del self._by_key[entry.key]
        return page

    # ---- storing and finding ---------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._lru)

    def store(self, entry: Entry) -> None:
        """A cached GPU page is being evicted: keep a copy of it on the host (when a host page is free or held
        only by older stored copies)."""
        if entry.key in self._by_key:
            self._lru.move_to_end(self._by_key[entry.key].page)
            return
        if not self.pool.can_allocate(1):
            return
        [page] = self.pool.allocate(1)
        self.host.store(self.gpu, [entry.page], [page])
        stored = _Stored(entry.key, entry.parent.key if entry.parent else b"", entry.tokens, page)
        self._by_key[entry.key] = stored
        self._lru[page] = stored
        self.pool.deallocate([page])  # idle: released() keeps it
        self.counters["prefix_host_stored_pages"] += 1

    def match(self, tokens: list[int], start_page: int, parent_key: bytes, max_pages: int) -> list[int]:
        """Host pages continuing a prefix: pages start_page, start_page + 1, ... of `tokens` (the GPU hits end
        before start_page, their last key is parent_key), at most up to page max_pages (exclusive)."""
        ps = self.pool.page_size
        found, key = [], parent_key
        for i in range(start_page, max_pages):
            chunk = tuple(tokens[i * ps:(i + 1) * ps])
            key_i = page_key(key, chunk)
            stored = self._by_key.get(key_i)
            if stored is None or stored.tokens != chunk or stored.parent != key:
                break
            found.append(stored.page)
            self._lru.move_to_end(stored.page)
            key = key_i
        return found

    def load(self, host_pages: list[int], gpu_pages: list[int]) -> None:
        """Copies stored pages back into GPU pages (every layer, codes and scales)."""
        copy_to_gpu(self.host, self.gpu, host_pages, gpu_pages)
        self.hit(host_pages)

    def hit(self, host_pages: list[int]) -> None:
        self.counters["prefix_host_hits"] += 1
        self.counters["prefix_host_hit_tokens"] += len(host_pages) * self.pool.page_size

    def keep(self, tokens: list[int], host_pages: list[int]) -> int:
        """A windowed sequence is about to release its host pages; host_pages[i] holds the KV of page i of `tokens`
        (written through: full and computed, as a cold prefill computes it). Each one whose prefix is not stored yet becomes a stored page as it is
        (idle once released). Returns how many."""
        ps = self.pool.page_size
        key, new = b"", []
        for i, page in enumerate(host_pages):
            chunk = tuple(tokens[i * ps:(i + 1) * ps])
            parent, key = key, page_key(key, chunk)
            if key not in self._by_key and self.pool.refcount(page) == 1 and len(chunk) == ps:
                new.append(_Stored(key, parent, chunk, page))
        for stored in reversed(new):  # the chain's head is used most recently: evicted last
            self._by_key[stored.key] = stored
            self._lru[stored.page] = stored
        self.counters["prefix_host_stored_pages"] += len(new)
        return len(new)


def copy_to_gpu(host: HostPool, gpu: KVCache, host_pages: list[int], gpu_pages: list[int]) -> None:
    """Copies host pages into GPU pages (every layer, codes and scales), done when this returns."""
    for layer in range(gpu.num_layers):
        for g, h in zip(gpu.layer_tensors(layer), host.kv.layer_tensors(layer)):
            for hp, gp in zip(host_pages, gpu_pages):
                g[gp].copy_(h[hp], non_blocking=host.pinned)
    if host.pinned:  # the host pages may be reused as soon as this returns
        torch.cuda.current_stream().synchronize()
