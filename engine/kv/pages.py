"""The page pool: which KV pages are free, and which sequence holds which."""
from __future__ import annotations

from collections import deque


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise MemoryError(f"asked for {num_pages} KV pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_pages)]

    def deallocate(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def grow_to(self, pages: list[int], num_tokens: int) -> bool:
        """Extends a sequence's page list to hold num_tokens; False (and no change) when the pool is short."""
        missing = self.pages_for(num_tokens) - len(pages)
        if missing <= 0:
            return True
        if not self.can_allocate(missing):
            return False
        pages.extend(self.allocate(missing))
        return True
