"""A windowed sequence's tiered page table: attention sink + recent window + retrieved pages on the GPU, every full
page on the host.

Logical page i of a sequence holds its tokens [64 i, 64 i + 64). A windowed sequence owns a fixed set of GPU pages
(its footprint, taken from the GPU pool once) and reuses them as a ring:

- page 0, the attention sink, stays on the GPU;
- the window: the pages holding the last `window` tokens before this step, plus the pages this step writes;
- staging pages: per layer, the `retrieve` older pages whose Quest bound (engine/memory/kv/summary.py) is largest for
  this step's queries, copied from the host tier (engine/memory/kv/host.py).

Each page is written through to the host when it is full and computed, so a page leaving the window is simply
forgotten on the GPU.

What a windowed step computes depends on where the step starts (the window is counted back from the step's start,
and Quest selection takes every query row of the step into account), so a token's KV depends on the chunk it was
computed in. Prefill chunks of a windowed sequence therefore always start at multiples of the prefill chunk
(engine/scheduler.py), and prefix reuse is exact: a table records how far its KV is what a cold prefill of the same
tokens computes (``exact``: complete aligned chunks, and steps that attend to the whole context), only those pages go
to the host prefix store, and a sequence starts from a reused prefix only at a chunk boundary, or where a step
still attends to the whole context (``reuse_depth``).

Prefix reuse: a windowed sequence whose prompt starts with cached full pages starts from them (``preload``): pages
cached on the GPU (engine/memory/kv/prefix.py) are copied to its host pages (with their Quest summaries), pages in the host
prefix store (engine/memory/kv/hostprefix.py) are taken over as its host pages without a copy, and the sink and the pages
the first window needs are copied to its GPU pages. When it ends, its exact written-through pages go to the host
prefix store as they are. Keys carry RoPE, so for a decode step the order of pages does not matter; a step of several
tokens (a prefill chunk, a verification step) sees sink and retrieved pages whole and the window causally.
"""
from __future__ import annotations

import logging
import torch

from engine.memory.kv.cache import KVCache
from engine.memory.kv.host import HostPool
from engine.errors import NInferError
from engine.memory.kv.hostprefix import HostPrefixStore, copy_to_gpu
from engine.memory.kv.summary import page_summary, select_pages
from engine.memory.geometry import WindowSpec, sequence_reach, tier_problems
from engine.batch import SeqSlice

log = logging.getLogger("ninfer.kvmem")


class TieredPages(list):
    """The GPU pages a windowed sequence owns (the list itself, so that releasing it to the GPU pool works like any
    page list), with the mapping of logical pages to GPU and host pages.

    A step may compute several tokens (a prefill chunk, or a speculative verification step) and a sequence may give
    tokens back (rejected drafts): only pages entirely below the computed length are ever written through, and the
    slots past it are overwritten by later steps, so grow and shrink leave the table alone. (The page-table
    interface: engine.memory.kv.table.PageTable.)"""

    windowed = True

    def __init__(self, gpu_pages: list[int], spec: WindowSpec, host: HostPool, host_pages: list[int],
                 resident: dict[int, int] | None = None):
        super().__init__(gpu_pages)
        self.spec, self.host = spec, host
        self.resident = dict(resident or {})  # logical page -> GPU page
        spare = [p for p in gpu_pages if p not in set(self.resident.values())]
        r = spec.retrieve_pages
        self.staging = spare[:r]  # GPU pages that receive retrieved pages, the same ids for every layer
        self.free = spare[r:]
        self.host_pages: list[int] = []  # logical page -> host page, for the pages written through
        self.host_spare = list(host_pages)  # reserved host pages not written yet
        self.staged = [[-1] * r for _ in range(host.kv.num_layers)]  # per layer and staging slot: logical page
        self.lo = 0  # first logical page of this step's window (pages 1..lo-1 are on the host only)
        self.start = 0
        self.evictions = 0
        self.exact = 0  # tokens [0, exact) hold the KV a cold prefill of the same tokens computes
        self.selections, self.outside_mass = 0, 0.0  # Quest selections made, and their summed bound mass left out
        self.last_outside = 0.0  # the largest share left out by a selection of the latest step
        self._candidates: torch.Tensor | None = None  # host pages of logical pages 1..lo-1, set by prepare

    @property
    def all_host_pages(self) -> list[int]:
        return self.host_pages + self.host_spare

    def preload(self, gpu: KVCache, gpu_src: list[int], host_src: list[int]) -> int:
        """Starts the table from cached prefix pages, before its first step: logical pages 0.. are the GPU pages
        gpu_src (copied to reserved host pages, Quest summaries computed) then the host pages host_src (already
        the table's: taken over from the prefix store, summaries kept). The sink and the pages the first window
        needs are copied to GPU pages. Returns the tokens they hold."""
        ps, k = self.spec.page_size, len(gpu_src) + len(host_src)
        dst = self.host_spare[:len(gpu_src)]
        del self.host_spare[:len(gpu_src)]
        self.host.store(gpu, gpu_src, dst)
        self.host_pages = dst + list(host_src)
        lo = max(0, (k * ps - self.spec.window) // ps)
        need = [i for i in range(k) if i == 0 or i >= lo]
        for i in need:
            self.resident[i] = self.free.pop()
        from_gpu = [(gpu_src[i], self.resident[i]) for i in need if i < len(gpu_src)]
        from_host = [(self.host_pages[i], self.resident[i]) for i in need if i >= len(gpu_src)]
        if from_gpu:
            gpu.copy_pages([s for s, _ in from_gpu], [d for _, d in from_gpu])
        copy_to_gpu(self.host, gpu, [s for s, _ in from_host], [d for _, d in from_host])
        self.exact = k * ps  # reused at a depth reuse_depth allows, from pages exact where they came from
        return k * ps

    # ---- the page-table interface (engine.memory.kv.table.PageTable) ---------------------------------------------------
    def grow(self, pool, num_tokens: int) -> bool:
        return True  # its footprint holds every GPU page any step needs

    def shrink(self, pool, num_tokens: int) -> None:
        pass  # tokens past the sequence's length are simply overwritten later

    def slots(self, start: int, n: int) -> list[int]:
        ps = self.spec.page_size
        return [self.resident[p // ps] * ps + p % ps for p in range(start, start + n)]

    def seq_slice(self, q_start: int, n: int, ctx: int, device) -> SeqSlice:
        return SeqSlice(q_start, n, ctx, None, self)

    # ---- before a step ----------------------------------------------------------------------------------------
    def bind(self, gpu: KVCache, start: int, n: int) -> None:
        """Makes tokens [start, start + n) writable and their window resident: writes the full pages before `start`
        through to the host, drops from the GPU the ones that left the window, maps the pages this step needs."""
        ps = self.spec.page_size
        full = start // ps
        new = list(range(len(self.host_pages), full))
        if new:
            if len(new) > len(self.host_spare):
                raise MemoryError(f"a windowed sequence needs {len(new)} more host KV pages, "
                                  f"{len(self.host_spare)} reserved")
            dst = self.host_spare[:len(new)]
            del self.host_spare[:len(new)]
            self.host.store(gpu, [self.resident[i] for i in new], dst)
            self.host_pages.extend(dst)
        lo = max(0, (start - self.spec.window) // ps)
        for i in [i for i in self.resident if 0 < i < lo]:
            self.free.append(self.resident.pop(i))
            self.evictions += 1
        for i in range(lo, (start + n - 1) // ps + 1):
            if i not in self.resident:
                self.resident[i] = self.free.pop()
        self.lo, self.start = lo, start
        self.last_outside = 0.0
        if start < self.exact:  # tokens computed again (rolled-back drafts): their KV is this step's
            self.exact = start
        if start == self.exact and self._computes_as_cold(start, n):
            self.exact = start + n
        # the candidates' host pages, as one tensor for every layer's selection in this step
        self._candidates = torch.tensor(self.host_pages[1:lo], dtype=torch.long, device=self.host.kmin.device) \
            if lo > 1 and self.spec.retrieve_pages else None

    def _computes_as_cold(self, start: int, n: int) -> bool:
        """Whether a step over tokens [start, start + n) computes their KV as a cold prefill does: a whole chunk
        starting at a multiple of the prefill chunk, or a step that, like the chunks a cold prefill computes these
        tokens in, attends to the whole context (its window reaches back to the sink: no selection)."""
        spec, ps = self.spec, self.spec.page_size
        if start % spec.chunk == 0 and n == spec.chunk:
            return True
        latest = max(start, (start + n - 1) // spec.chunk * spec.chunk)  # this step's, or the cold chunk's start
        return (latest - spec.window) // ps <= 1

    @property
    def exact_pages(self) -> int:
        """Written-through pages whose KV a cold prefill of the same tokens computes: the ones a later sequence
        may reuse."""
        return min(len(self.host_pages), self.exact // self.spec.page_size)

    # ---- during a layer's attention ---------------------------------------------------------------------------
    def page_list(self, gpu: KVCache, layer: int, q: torch.Tensor, ctx: int) -> tuple[torch.Tensor, int, int]:
        """The GPU pages this step attends to for this layer, in order: the sink and the retrieved pages (full),
        then the window's (full but the last); the tokens they hold; and how many of those come before the window.
        What the paged decode kernel reads (keys carry RoPE: for one query the order does not matter).

        q: this step's queries of the sequence [q_len, Hq, D], in the basis the keys are stored in."""
        ps, lo = self.spec.page_size, self.lo
        last = (ctx - 1) // ps
        if lo <= 1:  # the window reaches back to the sink: one contiguous run of pages
            lo, head = 0, []
        else:
            head = [self.resident[0]] + self._retrieve(gpu, layer, q, lo)
        window = [self.resident[i] for i in range(lo, last + 1)]
        pages = torch.tensor(head + window, dtype=torch.long, device=q.device)
        return pages, len(head) * ps + ctx - lo * ps, len(head) * ps

    def context(self, gpu: KVCache, layer: int, q: torch.Tensor, ctx: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K and V [n, Hkv, D] this step attends to for this layer, and the [q_len, n] mask (None: all visible).

        q: this step's queries of the sequence [q_len, Hq, D], in the basis the keys are stored in."""
        device = q.device
        pages, length, before = self.page_list(gpu, layer, q, ctx)
        keys, values = gpu.gather(layer, pages, length, dtype)
        mask = None
        q_len = q.shape[0]
        if q_len > 1:  # the window's rows are positions ctx - (length - before) .. ctx - 1; the ones before, all seen
            rows = torch.arange(q_len, device=device).unsqueeze(1) + (ctx - q_len)
            cols = torch.arange(length, device=device).unsqueeze(0) + (ctx - length)
            mask = (cols <= rows) | (torch.arange(length, device=device) < before).unsqueeze(0)
        return keys, values, mask

    def _retrieve(self, gpu: KVCache, layer: int, q: torch.Tensor, lo: int) -> list[int]:
        """Selects this layer's pages among 1..lo-1 and makes sure they are staged; returns their GPU pages."""
        r = self.spec.retrieve_pages
        if r == 0:
            return []
        host_ids = self._candidates
        chosen, scores, outside = select_pages(q, self.host.kmin[layer].index_select(0, host_ids),
                                               self.host.kmax[layer].index_select(0, host_ids), r, mass=True)
        chosen = [c + 1 for c in chosen]  # logical pages
        self.selections += 1
        self.outside_mass += outside
        self.last_outside = max(self.last_outside, outside)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kvmem select layer=%d pages=%s scores=[%s] outside=%.3g", layer, chosen,
                      ", ".join(f"{s:.3g}" for s in scores), outside)
        staged = self.staged[layer]
        wanted = set(chosen)
        slots = {page: i for i, page in enumerate(staged) if page in wanted}
        open_slots = [i for i, page in enumerate(staged) if page not in wanted]
        missing = [page for page in chosen if page not in slots]
        for page, i in zip(missing, open_slots):
            staged[i], slots[page] = page, i
        self.host.fetch(gpu, layer, [self.host_pages[p] for p in missing],
                        [self.staging[slots[p]] for p in missing])
        return [self.staging[slots[p]] for p in chosen]

    # ---- checks ----------------------------------------------------------------------------------------------
    def check(self, gpu: KVCache, computed: int) -> None:
        """Asserts the table's invariants against a recomputation (for tests: engine/memory/attention.py runs it
        after every admission when asked), `computed` being the sequence's computed tokens: the footprint split
        into resident, staging and free pages; host pages distinct and held; every written-through page's Quest
        summary equal to the one recomputed from its host keys; the sink and every page the next step's window
        reads resident, and equal (every layer, codes and scales) to its host copy where it has one; staged pages
        equal to their host copies; the exact prefix within the computed tokens."""
        ps, spec = self.spec.page_size, self.spec
        resident = list(self.resident.values())
        assert len(set(self)) == len(self) == spec.footprint, "the footprint's GPU pages"
        assert sorted(resident + self.staging + self.free) == sorted(self), "resident + staging + free = footprint"
        hosted = self.all_host_pages
        assert len(set(hosted)) == len(hosted) and all(self.host.pool.refcount(p) > 0 for p in hosted)
        assert len(self.host_pages) <= computed // ps and self.exact <= computed
        if self.host_pages:
            ids = torch.tensor(self.host_pages, dtype=torch.long)
            dev = ids.to(self.host.kmin.device)
            for layer in range(gpu.num_layers):
                lo, hi = page_summary(self.host.kv.gather_keys(layer, ids), ps)
                torch.testing.assert_close(self.host.kmin[layer].index_select(0, dev).cpu(), lo.cpu(),
                                           msg=lambda m: f"Quest minima of layer {layer}: {m}")
                torch.testing.assert_close(self.host.kmax[layer].index_select(0, dev).cpu(), hi.cpu(),
                                           msg=lambda m: f"Quest maxima of layer {layer}: {m}")
        window = max(0, (computed - spec.window) // ps)
        needed = {0, *range(window, -(-computed // ps))} if computed else set()
        assert needed <= set(self.resident), f"window pages {sorted(needed - set(self.resident))} not resident"
        pairs = [(self.resident[i], self.host_pages[i], None) for i in sorted(self.resident)
                 if i < len(self.host_pages) and i in needed]
        pairs += [(self.staging[slot], self.host_pages[page], layer) for layer, slots in enumerate(self.staged)
                  for slot, page in enumerate(slots) if page >= 0]
        for gpu_page, host_page, only in pairs:
            for layer in range(gpu.num_layers) if only is None else [only]:
                for g, h in zip(gpu.layer_tensors(layer), self.host.kv.layer_tensors(layer)):
                    assert torch.equal(g[gpu_page].cpu(), h[host_page]), \
                        f"GPU page {gpu_page} differs from host page {host_page} (layer {layer})"


class Tiering:
    """What the scheduler asks of the tiers: which sequences are windowed, opening and releasing their tables."""

    def __init__(self, spec: WindowSpec, host: HostPool, gpu: KVCache):
        self.spec, self.host, self.gpu = spec, host, gpu
        self.evictions = 0  # GPU pages dropped by windowed sequences that have ended
        self.selections, self.outside_mass = 0, 0.0  # of windowed sequences that have ended

    def reuse_depth(self, pages: int) -> int:
        """Of `pages` matched prefix pages, how many a windowed sequence starts from: the most that end where a cold
        prefill of its tokens starts a chunk (a multiple of the prefill chunk), or where a step still attends to
        the whole context (its window reaches the sink, as the cold chunk's does), so that every step after them
        computes what the cold prefill's steps compute."""
        spec, ps = self.spec, self.spec.page_size
        while pages and pages * ps % spec.chunk and (pages * ps - spec.window) // ps > 1:
            pages -= 1
        return pages

    def host_pages_for(self, tokens: int) -> int:
        return -(-tokens // self.spec.page_size)

    def can_open(self, gpu_free: int, held: int, reserve_tokens: int) -> bool:
        return (self.spec.footprint - held <= gpu_free
                and self.host_pages_for(reserve_tokens) <= self.host.pool.num_free)

    def open(self, gpu_pages: list[int], reserve_tokens: int, computed: int, gpu_src: list[int] = (),
             host_src: list[int] = ()) -> TieredPages:
        """A tiered table over `gpu_pages` (the footprint: a plain sequence's pages first, their contents kept for
        the first `computed` tokens) with host pages reserved for `reserve_tokens`; or, with gpu_src / host_src, a
        table that starts from those cached prefix pages (TieredPages.preload; host_src are idle pages of the host
        prefix store, taken over)."""
        held = -(-computed // self.spec.page_size)
        self.host.pool.share(list(host_src))
        host = self.host.pool.allocate(self.host_pages_for(reserve_tokens) - len(host_src))
        table = TieredPages(gpu_pages, self.spec, self.host, host, {i: gpu_pages[i] for i in range(held)})
        table.exact = computed  # a plain sequence's tokens: computed attending to the whole context, as cold
        if gpu_src or host_src:
            table.preload(self.gpu, list(gpu_src), list(host_src))
        return table

    def release(self, table: TieredPages, tokens: list[int] | None = None, store=None) -> None:
        """Gives the table's host pages back; with a host prefix store, its written-through pages (those of
        `tokens`) are kept there first."""
        self.evictions += table.evictions
        self.selections += table.selections
        self.outside_mass += table.outside_mass
        table.evictions, table.selections, table.outside_mass = 0, 0, 0.0
        if store is not None and tokens is not None:  # only pages a cold prefill would compute alike
            store.keep(tokens, table.host_pages[:table.exact_pages])
        self.host.pool.deallocate(table.all_host_pages)
        table.host_pages, table.host_spare = [], []


def _refuse(p) -> None:
    raise NInferError(p.message + ".", p.remedy[0].upper() + p.remedy[1:] + ".")


def plan_tiers(pools, *, window: int, retrieve: int, ring: str, chunk: int, allow_lossy: bool,
               speculative: bool = False) -> tuple[Tiering | None, int, str]:
    """The tiers an engine runs with on `pools` (engine/memory/build.Pools): (Tiering or None, the most tokens one
    sequence may hold, what limits it). Raises NInferError for a combination that cannot work
    (engine.memory.geometry.tier_problems, on those pools), naming the remedy."""
    pool = pools.pages
    ps, host = pool.page_size, pools.host
    problems = tier_problems(dict(
        kv_window=window, kv_retrieve=retrieve, kv_ring=ring, host_kv_mib=int(host is not None and window > 0),
        kv_capacity=pool.num_pages * ps, max_context=0, prefill_chunk=chunk, allow_lossy_window=allow_lossy,
        kv_reuse_hostbacked=False, max_shared_prefixes=1, host_pageable=False, spec="mtp" if speculative else ""))
    if problems:
        _refuse(problems[0])
    on_device, tiered = sequence_reach(pool.num_pages, host.num_pages if host is not None else 0, window, ring, ps)
    if window <= 0:
        return None, on_device, "the KV cache capacity"
    window = WindowSpec.round(window, ps)
    if ring == "off":
        return None, on_device, (f"the KV window (--kv-window {window} with --kv-ring off; "
                                 f"--kv-ring auto with --host-kv-mib runs longer contexts)")
    spec = WindowSpec(window, WindowSpec.round(retrieve, ps), ring, chunk, ps)
    if spec.lossy:
        log.warning("KV window %d tokens without retrieval (--allow-lossy-window): context older than the window "
                    "is dropped from attention (lossy)", window)
    return Tiering(spec, host, pools.kv), tiered, "the host KV tier (--host-kv-mib)"


def tier_stats(host: HostPool | None, tiers: Tiering | None, scheduler) -> dict:
    """The KV-tier part of Engine.stats(): host pages, retrieval traffic, window and evictions."""
    windowed = [seq.pages for seq in scheduler.running if seq.pages.windowed]
    spec = tiers.spec if tiers is not None else None
    out = dict(kv_host_pages_total=host.num_pages if host else 0,
               kv_host_pages_used=host.pool.num_used if host else 0,
               kv_host_pages_free=host.pool.num_free if host else 0,
               kv_window_tokens=spec.window if spec else 0, kv_retrieve_tokens=spec.retrieve if spec else 0,
               kv_ring=spec.ring if spec else "off", kv_lossy=bool(spec and spec.lossy),
               kv_windowed_sequences=len(windowed),
               kv_evictions=(tiers.evictions if tiers else 0) + sum(t.evictions for t in windowed))
    selections = (tiers.selections if tiers else 0) + sum(t.selections for t in windowed)
    outside = (tiers.outside_mass if tiers else 0.0) + sum(t.outside_mass for t in windowed)
    # how unsure retrieval is: the share of Quest bound mass left on the host, per selection since start, and the
    # largest share of a running sequence's latest step
    out.update(kv_select_outside_mass=outside / selections if selections else 0.0,
               kv_select_outside_mass_now=max((t.last_outside for t in windowed), default=0.0))
    out.update(host.counters if host else dict(kv_writethrough_pages=0, kv_retrieved_pages=0, kv_retrieved_bytes=0,
                                               kv_retrieve_seconds=0.0))
    return out


def host_backed_prefixes(pools, prefix, enabled: bool):
    """The host store of evicted prefix pages (--kv-reuse-hostbacked) on `pools`' host tier, attached to the GPU
    prefix cache; None when off. Raises NInferError when it cannot work."""
    host = pools.host
    if prefix is not None:
        prefix.backing = None
    if not enabled:
        return None
    problems = tier_problems(dict(
        kv_window=0, kv_retrieve=0, kv_ring="auto", host_kv_mib=int(host is not None), kv_capacity="auto",
        max_context=0, prefill_chunk=0, allow_lossy_window=False, kv_reuse_hostbacked=True,
        max_shared_prefixes=int(prefix is not None), host_pageable=False, spec=""))
    if problems:
        _refuse(problems[0])
    store = HostPrefixStore.for_host(host, pools.kv)
    prefix.backing = store
    return store
