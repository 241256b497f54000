"""A sequence's page table: where each of its positions' K/V lives in the paged cache.

Two kinds answer the same questions: the plain page list below (logical page i is GPU page table[i]) and the
windowed table of a sequence that runs on KV tiers (engine.memory.kv.window.TieredPages). The runner, the scheduler's
memory managers and the speculator call these methods and never ask which kind a table is."""
from __future__ import annotations

from typing import Protocol

import torch

from engine.batch import SeqSlice


class PageTable(Protocol):
    """`pool` below is the engine.memory.kv.pages.PagePool the table's pages come from."""

    windowed: bool  # KV tiers: a fixed GPU footprint, pages in no logical order
    evictions: int  # GPU pages it dropped from its window (0 for a plain list)

    def grow(self, pool, num_tokens: int) -> bool: ...  # holds num_tokens; False (no change): pool short

    def shrink(self, pool, num_tokens: int) -> None: ...  # gives back the pages past num_tokens

    def bind(self, kv, start: int, n: int) -> None: ...  # before a step computing tokens [start, start + n)

    def slots(self, start: int, n: int) -> list[int]: ...  # flat KV slots (page * page_size + offset) of positions

    def seq_slice(self, q_start: int, n: int, ctx: int, device) -> SeqSlice: ...  # this step's attention metadata


class PageList(list):
    """The plain page table: logical page i is page self[i] of the pool; pages are taken as the sequence grows."""

    windowed = False
    evictions = 0

    def __init__(self, pages=(), page_size: int | None = None):
        super().__init__(pages)
        self.page_size = page_size

    def __getitem__(self, index):
        got = super().__getitem__(index)
        return PageList(got, self.page_size) if isinstance(index, slice) else got  # a slice is a page table too

    def grow(self, pool, num_tokens: int) -> bool:
        self.page_size = pool.page_size
        missing = pool.pages_for(num_tokens) - len(self)
        if missing <= 0:
            return True
        if not pool.can_allocate(missing):
            return False
        self.extend(pool.allocate(missing))
        return True

    def shrink(self, pool, num_tokens: int) -> None:
        keep = pool.pages_for(num_tokens)
        if keep < len(self):
            pool.deallocate(self[keep:])
            del self[keep:]

    def bind(self, kv, start: int, n: int) -> None:
        self.page_size = kv.page_size

    def slots(self, start: int, n: int) -> list[int]:
        ps = self.page_size
        return [self[p // ps] * ps + p % ps for p in range(start, start + n)]

    def seq_slice(self, q_start: int, n: int, ctx: int, device) -> SeqSlice:
        held = list.__getitem__(self, slice(0, -(-ctx // self.page_size)))
        pages = torch.tensor(held, dtype=torch.long, device=device)
        # consecutive page ids are read as one view of the cache on the CPU (KVCache.gather)
        run = held[-1] - held[0] == len(held) - 1 and held == list(range(held[0], held[-1] + 1))
        return SeqSlice(q_start, n, ctx, pages, first_page=held[0] if run else None)
