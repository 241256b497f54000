"""What identifies an image for the caches (issue #36): its content hash, and the ids its placeholder tokens take in
the prefix cache's keys.

Every image stands in the prompt as the same run of <|image_pad|> tokens, so keys over token ids alone would let one
image's KV pages serve another's. `image_hash` is the SHA-256 of the image's encoded bytes (of its mode, size and
pixel values for a Pillow image) and of its patch grid; `key_ids` gives each placeholder of the image an id outside
every vocabulary (at and above 2**62), derived from that hash and the token's offset in the image. A sequence's
`KeyTokens` are its tokens with those ids in place of the placeholders: the prefix cache (engine/memory/kv/prefix.py,
hostprefix.py) and the recurrent-state snapshots (engine/memory/state.py) key by them, so the same image at the same
place matches and a different one never does (two images' ids agree only where 62 bits of their hashes nearly do).
The same hash keys the tower's output rows (engine/model/encoder_cache.py)."""
from __future__ import annotations

import bisect
import hashlib

from PIL import Image

KEY_BASE = 1 << 62  # above any vocabulary; array("q") and torch.int64 still hold it
_KEY_MASK = KEY_BASE - 1


def image_hash(image, grid: tuple[int, int, int]) -> bytes:
    """SHA-256 of the image as given (encoded bytes, or a Pillow image's mode, size and pixels) and its grid."""
    h = hashlib.sha256()
    if isinstance(image, Image.Image):
        h.update(f"pillow {image.mode} {image.width}x{image.height}".encode())
        h.update(image.tobytes())
    else:
        h.update(b"encoded ")
        h.update(bytes(image))
    h.update(" grid {} {} {}".format(*grid).encode())
    return h.digest()


def key_ids(digest: bytes, count: int) -> list[int]:
    """The prefix-cache ids of an image's `count` placeholder tokens, in order."""
    base = int.from_bytes(digest[:8], "little") & _KEY_MASK
    return [KEY_BASE | ((base + offset) & _KEY_MASK) for offset in range(count)]


class KeyTokens:
    """A sequence's tokens as the caches key them: `tokens` (the live list, which grows as it decodes) with the
    placeholder at each index of `image_at` (sorted) read as the matching id of `ids`. Supports len, indexing and
    slicing (a list), which is all the caches use."""

    def __init__(self, tokens: list[int], image_at: list[int], ids: list[int]):
        self.tokens, self.image_at, self.ids = tokens, image_at, ids

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        if not isinstance(index, slice):
            i = range(len(self.tokens))[index]
            j = bisect.bisect_left(self.image_at, i)
            return self.ids[j] if j < len(self.image_at) and self.image_at[j] == i else self.tokens[i]
        start, stop, step = index.indices(len(self.tokens))
        if step != 1:
            return [self[i] for i in range(start, stop, step)]
        out = self.tokens[start:stop]
        lo, hi = bisect.bisect_left(self.image_at, start), bisect.bisect_left(self.image_at, stop)
        for j in range(lo, hi):
            out[self.image_at[j] - start] = self.ids[j]
        return out
