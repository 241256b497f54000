"""The vision tower's output rows per image, kept so that an image sent again (a resent conversation, another
question about the same screenshot) does not run the tower again.

Keyed by the image's content hash (engine/model/image_keys.py: the encoded bytes and the patch grid, so the same
processor gives the same rows), bounded in bytes, least recently used evicted first. The rows live in host memory
(outside the GPU budget the KV pool was sized into); the ledger counts the bound as its own host line
(engine/ledger/vision.py: ENCODER_CACHE_IMAGES of the largest images)."""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.counters = dict(encoder_cache_hits=0, encoder_cache_misses=0, encoder_cache_evictions=0)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._rows

    def get(self, digest: bytes) -> torch.Tensor | None:
        rows = self._rows.get(digest)
        self.counters["encoder_cache_hits" if rows is not None else "encoder_cache_misses"] += 1
        if rows is not None:
            self._rows.move_to_end(digest)
        return rows

    def put(self, digest: bytes, rows: torch.Tensor) -> None:
        """Keeps a host copy of one image's rows; one larger than the whole bound is not kept."""
        nbytes = rows.numel() * rows.element_size()
        if nbytes > self.max_bytes or digest in self._rows:
            return
        while self.bytes + nbytes > self.max_bytes:
            _, old = self._rows.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            self.counters["encoder_cache_evictions"] += 1
        self._rows[digest] = rows.detach().to("cpu", copy=True)
        self.bytes += nbytes

    def stats(self) -> dict:
        return dict(self.counters, encoder_cache_images=len(self._rows), encoder_cache_bytes=self.bytes,
                    encoder_cache_max_bytes=self.max_bytes)
