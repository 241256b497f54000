"""Sequence memory, built in one place from the model's cache specs (engine/memory/specs.py).

Two steps, as llama.cpp's hybrid memory builds its KV half and its recurrent half, and vLLM turns specs into managers:

- `allocate`: the pools the runner computes in: the KV cache of the attention layers (GPU pages and the host tier)
  and the state pool of the recurrent ones, sized by the ledger (engine/build.size_kv reads the same specs);
- `assemble`: what an engine runs on those pools under its settings: the prefix cache, the KV tiers and the reach
  of one sequence, and the MemoryManager the scheduler and the speculator ask."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.memory.kv.cache import KVCache
from engine.memory.kv.host import HostPool
from engine.memory.kv.pages import PagePool
from engine.memory.kv.prefix import PrefixCache, resolve_max_shared_prefixes
from engine.memory.kv.window import Tiering, host_backed_prefixes, plan_tiers
from engine.memory.attention import AttentionMemory
from engine.memory.geometry import PAGE_SIZE
from engine.memory.manager import MemoryManager
from engine.memory.state import StateMemory, StatePool


@dataclass
class Pools:
    """The tensors sequence memory lives in. `pages` hands out the KV cache's pages (the cache has one more when
    padded: the scratch page of a padded batch's dummy rows); `host` is the host KV tier, `state` the recurrent
    layers' slots (None where the model has none)."""
    kv: KVCache
    pages: PagePool
    host: HostPool | None = None
    state: StatePool | None = None

    @property
    def page_size(self) -> int:
        return self.pages.page_size


def allocate(specs: list, device: torch.device | str, num_pages: int, kv_dtype: torch.dtype,
             page_size: int = PAGE_SIZE, *, host_pages: int = 0, host_pinned: bool = True, state_slots: int = 0,
             padded: bool = False, state_scratch: bool = False) -> Pools:
    """The pools for a model's `specs` (one per layer): the KV cache holds the attention layers (indexed by their
    ordinal among them), the state pool the recurrent ones, `state_slots` sequences of them (`state_scratch`: one
    more slot, stepped by a padded batch's dummy rows)."""
    attention = [s for s in specs if s.kind == "attention"]
    recurrent = [s for s in specs if s.kind == "recurrent"]
    if recurrent and state_slots < 1:
        raise ValueError("a model with recurrent layers needs state_slots >= 1")
    device = torch.device(device)
    kv = KVCache(len(attention), num_pages + padded, attention[0].num_kv_heads, attention[0].head_dim, kv_dtype,
                 device, page_size)
    state = StatePool(recurrent, state_slots, device, scratch=state_scratch) if recurrent else None
    host = HostPool(kv, host_pages, host_pinned) if host_pages else None
    return Pools(kv, PagePool(num_pages, page_size), host, state)


@dataclass
class EngineMemory:
    """An engine's sequence memory: the manager it asks, and what it was built with."""
    manager: MemoryManager
    prefix: PrefixCache | None  # cached prompt prefixes (None: reuse off)
    tiers: Tiering | None  # the GPU window + host pages + retrieval (None: no window)
    reach: int  # the most tokens one sequence may hold
    reach_what: str  # what sets the reach, for error messages


def assemble(pools: Pools, config, *, speculative: bool = False,
             state_snapshots: int = 0) -> EngineMemory:
    """The memory an engine runs with on `pools` under the prefix and KV-tier settings of `config` (the engine's
    EngineConfig, engine/config/engine_config.py, read by name: the settings check themselves with memory's numbers,
    so memory does not import them). `speculative`: a speculator that needs the target's hidden states;
    `state_snapshots`: recurrent-state snapshots kept for prefix reuse. Raises NInferError for a tier combination that cannot work, naming the remedy. The prefix cache lives
    with the page pool, i.e. with the model: a later engine over the same pools keeps it."""
    c = config
    prefix = PrefixCache.for_pool(pools.pages, resolve_max_shared_prefixes(c.max_shared_prefixes,
                                                                           c.max_concurrency))
    tiers, reach, what = plan_tiers(pools, window=c.kv_window, retrieve=c.kv_retrieve, ring=c.kv_ring,
                                    chunk=c.prefill_chunk, allow_lossy=c.allow_lossy_window,
                                    speculative=speculative)
    attention = AttentionMemory(pools.pages, prefix, tiers,
                                host_backed_prefixes(pools, prefix, c.kv_reuse_hostbacked), kv=pools.kv)
    state = None
    if pools.state is not None:
        state = StateMemory(pools.state, pools.page_size, state_snapshots if prefix is not None else 0)
    return EngineMemory(MemoryManager(attention, state), prefix, tiers, reach, what)
