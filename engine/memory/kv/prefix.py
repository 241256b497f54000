"""Automatic prefix reuse: full KV pages are remembered by the tokens that led to them, and a new sequence whose
prompt starts with the same tokens shares those pages instead of computing them again.

- A page is identified by a key chained over token ids: ``key_i = blake2b(key_{i-1} + tokens of page i)``, so a key
  names the whole prefix up to and including its page. In a prompt with images each placeholder token counts as an
  id derived from its image's content hash and its offset in the image (``key_tokens``, engine/model/image_keys.py):
  pages after the same image match, pages after another image do not. An entry also keeps its page's tokens and
  its parent entry, and a hit compares both: a collision of these keys can only cost a miss, never serve the wrong
  KV (two images' placeholder ids agree only where 62 bits of their SHA-256 nearly do).
- Only full pages whose KV has been computed are registered, by the sequence that computed them; a registered page
  is never written again (a sequence writes only from its ``num_computed`` on, which is past every page it shares).
  When a sequence computes a page whose key is already cached (two requests prefilling the same prefix at once), it
  switches to the cached page and frees its own copy, so every holder of a cached page also holds all of that
  page's ancestors; the cached pages form a forest closed under "parent of".
- A hit never covers the page holding the last token to compute: it is capped at ``len(tokens) - 1`` tokens,
  rounded down to a page, so that token is computed (its logits are needed) and written into the sequence's own
  page.
- A cached page that no sequence holds is idle: it stays in an LRU (least recently released first, a chain's
  deeper pages before their parents) and counts as available. An allocation takes free pages first, then evicts
  idle leaves (pages with no cached child), so cached prefixes never cause a refusal.
- ``max_chains`` bounds the distinct cached prefixes (leaves of the forest): beyond it, the least recently used idle
  chains are evicted back to the free list, up to the first page another chain or a running sequence still needs.

Partial pages (copy on write). When a sequence releases its pages (finished, aborted or preempted), its partial last
page (the computed tokens past its last full page; generated tokens included, so a chat follow-up reuses the answer
too) stays cached as a *tail*: an entry under its last full page's entry (or a root), keyed by nothing but its
parent and its tokens. A tail is never shared through a page table (its owner would write beyond its tokens): it is
idle from the moment it is registered. At admission, after the full-page hits, ``match_partial`` looks among the
children of the last hit (tails, and full pages whose tokens only partly match or lie past the cap) for the longest
common token prefix with the next tokens, capped so that the last token is still computed; the scheduler copies that
page into the sequence's own fresh page (``KVCache.copy_pages``) and counts those tokens as computed. A tail is
kept only when it adds tokens: one whose tokens a sibling already starts with is not registered, and a longer one
replaces the tails it extends. A tail is a leaf, so it counts as a cached prefix against ``max_chains`` (when its
parent had no other child it takes over the parent's count). Tails are idle pages like others: evictable, counted
as free, never a cause of refusal; they are not copied to a host store (a tail is under a page of tokens: cheaper
to recompute than to keep).
"""
from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.memory.kv.pages import PagePool

log = logging.getLogger("ninfer.prefix")

AUTO_MIN_PREFIXES = 8  # max_shared_prefixes auto = max(max_concurrency, this)


def resolve_max_shared_prefixes(setting: int | str, max_concurrency: int) -> int:
    """The bound on cached prefixes: an int >= 0 as given (0 turns reuse off), or auto."""
    if setting == "auto":
        return max(max_concurrency, AUTO_MIN_PREFIXES)
    value = int(setting)
    if value < 0:
        raise ValueError(f"max_shared_prefixes must be auto or >= 0, not {setting!r}")
    return value


def key_tokens(seq):
    """The tokens a sequence's pages are keyed by: its token ids, with each image placeholder read as an id from
    that image's content hash (engine.sequence.Sequence.cache_tokens), so pages after different images differ."""
    return getattr(seq, "cache_tokens", seq.tokens)


def page_key(parent: bytes, tokens) -> bytes:
    """The chained key of a page: a strong hash of the parent's key and this page's token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(eq=False)
class Entry:
    key: bytes | None  # None for a tail (a partial page, never looked up by key)
    page: int
    tokens: tuple[int, ...]
    parent: "Entry | None"
    kids: dict = field(default_factory=dict)  # page -> cached entry whose parent this is (full pages and tails)

    @property
    def children(self) -> int:
        return len(self.kids)

    @property
    def is_tail(self) -> bool:
        return self.key is None


def common_prefix(a, b) -> int:
    """The number of leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class _Progress:
    """How far a running sequence's pages are registered: its first `pages` pages; `last` is the entry of the last."""
    seq: object
    pages: int
    last: Entry | None


class PrefixCache:
    def __init__(self, pool: PagePool, max_chains: int):
        if pool.cache is not None:
            raise ValueError("this page pool already has a prefix cache")
        self.pool = pool
        self.page_size = pool.page_size
        self.max_chains = max_chains
        self._by_key: dict[bytes, Entry] = {}  # full pages
        self._by_page: dict[int, Entry] = {}  # full pages and tails
        self._roots: dict[int, Entry] = {}  # page -> entry without a parent
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle cached pages, least recently released first
        self._progress: dict[int, _Progress] = {}  # id(sequence) -> its registration progress
        self._leaves = 0
        self.evicted_pages = 0
        self.backing = None  # engine.memory.kv.hostprefix.HostPrefixStore: evicted pages keep a host copy
        pool.cache = self

    @classmethod
    def for_pool(cls, pool: PagePool, max_chains: int) -> "PrefixCache | None":
        """The pool's prefix cache with this bound (the one already attached is kept: its pages stay valid for the
        same model), or None, with any cache emptied and detached, when max_chains is 0."""
        cache = pool.cache
        if max_chains <= 0:
            if cache is not None:
                cache.clear()
                pool.cache = None
            return None
        if cache is None:
            return cls(pool, max_chains)
        cache.max_chains = max_chains
        cache.trim()
        return cache

    # ---- what the pool asks ----------------------------------------------------------------------------------
    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def released(self, page: int) -> bool:
        if page in self._by_page:
            self._idle[page] = None
            return True
        return False

    def pinned(self, page: int) -> None:
        assert not self._by_page[page].is_tail, "a tail page is never shared"
        del self._idle[page]

    def evict(self) -> int:
        """Forgets the least recently used idle leaf page and returns it (the pool hands it out)."""
        for page in self._idle:
            entry = self._by_page[page]
            if entry.children == 0:
                self._evicted(entry)
                return page
        raise MemoryError("no idle cached page to evict")  # cannot happen: idle pages' cached children are idle

    # ---- what the scheduler asks -----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Cached pages in all (full and tails), held by sequences or idle."""
        return len(self._by_page)

    @property
    def num_tails(self) -> int:
        return len(self._by_page) - len(self._by_key)

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    @property
    def num_chains(self) -> int:
        """Distinct cached prefixes: the leaves of the forest (a tail is one)."""
        return self._leaves

    def reusable_tokens(self, num_tokens: int) -> int:
        """The most a full-page hit may cover for a sequence of num_tokens tokens (the last one is always computed)."""
        return max(num_tokens - 1, 0) // self.page_size * self.page_size

    def match(self, tokens: list[int]) -> list[Entry]:
        """The cached entries of the longest cached prefix of `tokens` (capped, see reusable_tokens)."""
        p = self.page_size
        found: list[Entry] = []
        key, parent = b"", None
        for i in range(self.reusable_tokens(len(tokens)) // p):
            chunk = tuple(tokens[i * p:(i + 1) * p])
            key = page_key(key, chunk)
            entry = self._by_key.get(key)
            if entry is None or entry.tokens != chunk or entry.parent is not parent:
                break
            found.append(entry)
            parent = entry
        return found

    def match_partial(self, tokens: list[int], hits: list[Entry]) -> tuple[Entry | None, int]:
        """After the full-page hits: the cached child of the last hit (a root, without hits) whose tokens share the
        longest prefix with the next tokens, and that length (0: none). At most len(tokens) - 1 tokens are reused
        in all. The caller copies the entry's page into its own page; a tail becomes the most recently used."""
        start = len(hits) * self.page_size
        nxt = tokens[start:min(start + self.page_size, len(tokens) - 1)]
        best, best_n = None, 0
        for kid in (hits[-1].kids if hits else self._roots).values():
            n = common_prefix(kid.tokens, nxt)
            if n > best_n:
                best, best_n = kid, n
        if best is not None and best.page in self._idle:
            self._idle.move_to_end(best.page)
        return best, best_n

    def admitted(self, seq, hits: list[Entry]) -> None:
        """`seq` runs with the hit pages as the head of its page table (the scheduler shared them)."""
        self._progress[id(seq)] = _Progress(seq, len(hits), hits[-1] if hits else None)

    def register(self, seq) -> None:
        """Registers the sequence's pages that are now full and computed."""
        prog = self._progress.get(id(seq))
        if prog is None or prog.seq is not seq:
            return
        p, tokens = self.page_size, key_tokens(seq)
        full = min(seq.num_computed, len(tokens)) // p
        if prog.pages >= full:
            return
        last = prog.last
        key = last.key if last is not None else b""
        while prog.pages < full:
            n = prog.pages
            chunk = tuple(tokens[n * p:(n + 1) * p])
            key = page_key(key, chunk)
            page = seq.pages[n]
            entry = self._by_key.get(key)
            if entry is None:
                entry = Entry(key, page, chunk, last)
                self._by_key[key] = entry
                for kid in list(self._kids(last).values()):  # tails this page covers add nothing now
                    if kid.is_tail and chunk[:len(kid.tokens)] == kid.tokens:
                        self._drop_idle(kid)
                self._add(entry)
            elif entry.page != page:
                if entry.tokens != chunk or entry.parent is not last:  # a key collision: stop caching this one
                    log.warning("prefix cache key collision; sequence %s is not cached further",
                                getattr(seq, "request_id", "?"))
                    del self._progress[id(seq)]
                    return
                # the same prefix was computed and cached meanwhile: share that page, give ours back
                self.pool.share([entry.page])
                self.pool.deallocate([page])
                seq.pages[n] = entry.page
            prog.pages, prog.last, last = n + 1, entry, entry
        self.trim()

    def keep_tail(self, seq) -> bool:
        """Called just before the sequence releases its pages: its partial last page (computed tokens past its last
        full page) stays cached as a tail of its last full page, unless a cached sibling already starts with those
        tokens. True when it was kept (the page then goes idle instead of free when released)."""
        self.register(seq)
        prog = self._progress.get(id(seq))
        if prog is None or prog.seq is not seq:
            return False
        p, all_tokens = self.page_size, key_tokens(seq)
        full, n = divmod(min(seq.num_computed, len(all_tokens)), p)
        if n == 0 or prog.pages != full or full >= len(seq.pages):
            return False
        page = seq.pages[full]
        if self.pool.refcount(page) != 1 or page in self._by_page:
            return False
        tokens = tuple(all_tokens[full * p:full * p + n])
        parent = prog.last
        for kid in list(self._kids(parent).values()):
            if kid.tokens[:n] == tokens:  # nothing new: a longer tail or a full page starts with these tokens
                if kid.page in self._idle:
                    self._idle.move_to_end(kid.page)
                return False
            if kid.is_tail and tokens[:len(kid.tokens)] == kid.tokens:  # ours extends it
                self._drop_idle(kid)
        self._add(Entry(None, page, tokens, parent))
        return True

    def forget(self, seq) -> None:
        """The sequence released its pages (finished, aborted or preempted)."""
        prog = self._progress.get(id(seq))
        if prog is not None and prog.seq is seq:
            del self._progress[id(seq)]
        self.trim()

    def trim(self) -> None:
        """Evicts least recently used idle chains while there are more than max_chains."""
        while self._leaves > self.max_chains:
            leaf = next((self._by_page[page] for page in self._idle if self._by_page[page].children == 0), None)
            if leaf is None:
                return  # the rest are held by running sequences: trimmed when they end
            entry = leaf
            while entry is not None and entry.children == 0 and self.pool.refcount(entry.page) == 0:
                parent = entry.parent
                self._evicted(entry)
                self.pool.give_back(entry.page)
                entry = parent

    def clear(self) -> None:
        """Forgets every cached page: idle ones go back to the pool, held ones are freed when released."""
        for page in list(self._idle):
            del self._idle[page]
            self.pool.give_back(page)
        self._by_key.clear()
        self._by_page.clear()
        self._roots.clear()
        self._progress.clear()
        self._leaves = 0

    def _kids(self, parent: Entry | None) -> dict[int, Entry]:
        return parent.kids if parent is not None else self._roots

    def _add(self, entry: Entry) -> None:
        self._by_page[entry.page] = entry
        kids = self._kids(entry.parent)
        self._leaves -= entry.parent is not None and not kids
        kids[entry.page] = entry
        self._leaves += 1

    def _evicted(self, entry: Entry) -> None:
        """An idle leaf leaves the cache for room (its page is handed out or given back by the caller)."""
        if self.backing is not None and not entry.is_tail:
            self.backing.store(entry)
        self._drop(entry)
        self.evicted_pages += 1

    def _drop_idle(self, entry: Entry) -> None:
        """Forgets an idle tail that another entry makes useless; its page is free again."""
        assert entry.is_tail and self.pool.refcount(entry.page) == 0
        self._drop(entry)
        self.pool.give_back(entry.page)

    def _drop(self, entry: Entry) -> None:
        assert entry.children == 0
        if entry.key is not None:
            del self._by_key[entry.key]
        del self._by_page[entry.page]
        self._idle.pop(entry.page, None)
        kids = self._kids(entry.parent)
        del kids[entry.page]
        self._leaves -= 1
        self._leaves += entry.parent is not None and not kids

    # ---- checks ----------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Asserts the cache's invariants (for tests): counts, forest closure, idle pages unheld, tails idle and
        partial, no tail that a sibling starts with."""
        p = self.page_size
        for key, entry in self._by_key.items():
            assert entry.key == key and self._by_page[entry.page] is entry and len(entry.tokens) == p
            assert page_key(entry.parent.key if entry.parent else b"", entry.tokens) == key
        for page, entry in self._by_page.items():
            assert entry.page == page
            assert entry.parent is None or self._by_page.get(entry.parent.page) is entry.parent
            assert entry.parent is None or not entry.parent.is_tail
            assert self._kids(entry.parent).get(page) is entry
            for kid in entry.kids.values():
                assert kid.parent is entry
            held = self.pool.refcount(page) > 0
            assert held != (page in self._idle)
            if held and entry.parent is not None:
                assert self.pool.refcount(entry.parent.page) > 0
            if entry.is_tail:
                assert 0 < len(entry.tokens) < p and not held and not entry.kids
                for sib in self._kids(entry.parent).values():
                    assert sib is entry or sib.tokens[:len(entry.tokens)] != entry.tokens, "a redundant tail"
        assert all(e.parent is None for e in self._roots.values())
        assert len(self._by_page) == len(self._by_key) + sum(e.is_tail for e in self._by_page.values())
        assert set(self._idle) <= set(self._by_page)
        assert self._leaves == sum(1 for e in self._by_page.values() if e.children == 0)
