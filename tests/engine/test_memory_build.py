"""engine/memory/build.py: the pools come from the cache specs alone, and an engine's memory from the pools and its
settings (reach, tiers, the prefix cache that stays with the pool)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config.engine_config import EngineConfig
from engine.errors import NInferError
from engine.memory.build import allocate, assemble
from engine.memory.geometry import PAGE_SIZE, sequence_reach
from engine.memory.specs import AttentionSpec, gated_delta_spec

PAGE = PAGE_SIZE  # the tier rules count in pages of this size
GDN = SimpleNamespace(conv_dim=24, conv_kernel=4, num_v_heads=2, head_k_dim=8, head_v_dim=4)


def hybrid_specs() -> list:
    """Three Gated-DeltaNet layers to one attention layer, twice over."""
    gdn, attention = gated_delta_spec(GDN, "float32", "float32"), AttentionSpec(2, 8)
    return [gdn, gdn, gdn, attention] * 2


def test_the_pools_hold_what_the_specs_say():
    pools = allocate(hybrid_specs(), "cpu", 5, torch.float32, PAGE, state_slots=3, padded=True, state_scratch=True)
    kv, state = pools.kv, pools.state
    assert kv.num_layers == 2 and kv.num_kv_heads == 2 and kv.head_dim == 8
    assert kv.num_pages == 6 and pools.pages.num_pages == 5  # the padded batch's scratch page is never handed out
    assert kv.page_bytes == 2 * PAGE * 2 * 8 * 4 * 2  # K and V of two layers, float32
    assert len(state.layers) == 6 and state.num_slots == 3 and state.scratch == 3
    assert state.layers[0]["ssm"].shape == (4, 2, 8, 4) and state.layers[0]["conv"].shape == (4, 24, 3)
    assert state.slot_bytes == 6 * (24 * 3 + 2 * 8 * 4) * 4
    assert pools.host is None


def test_a_model_of_attention_layers_has_no_state_pool_and_a_hybrid_needs_slots():
    assert allocate([AttentionSpec(2, 8)] * 3, "cpu", 4, torch.float32, PAGE).state is None
    with pytest.raises(ValueError, match="state_slots"):
        allocate(hybrid_specs(), "cpu", 4, torch.float32, PAGE)


def test_the_reach_is_the_pool_or_the_window_and_host_tier():
    pools = allocate([AttentionSpec(2, 8)] * 2, "cpu", 8, torch.float32, PAGE)
    plain = assemble(pools, EngineConfig(max_concurrency=2))
    assert plain.reach == 8 * PAGE and plain.tiers is None and plain.manager.state is None
    assert "capacity" in plain.reach_what

    tiered_pools = allocate([AttentionSpec(2, 8)] * 2, "cpu", 12, torch.float32, PAGE, host_pages=40)
    tiered = assemble(tiered_pools, EngineConfig(kv_window=4 * PAGE, kv_retrieve=PAGE, prefill_chunk=PAGE))
    assert tiered.tiers is not None and tiered.tiers.host is tiered_pools.host
    assert tiered.reach == sequence_reach(12, 40, 4 * PAGE, "auto", PAGE)[1] == 40 * PAGE
    assert "host" in tiered.reach_what


def test_a_window_without_a_host_tier_is_refused_by_name():
    pools = allocate([AttentionSpec(2, 8)], "cpu", 12, torch.float32, PAGE)
    with pytest.raises(NInferError, match="host"):
        assemble(pools, EngineConfig(kv_window=4 * PAGE, kv_retrieve=PAGE, prefill_chunk=PAGE, kv_ring="on"))


def test_the_prefix_cache_stays_with_the_pool_and_snapshots_only_with_reuse():
    pools = allocate(hybrid_specs(), "cpu", 8, torch.float32, PAGE, state_slots=2)
    first = assemble(pools, EngineConfig(max_concurrency=2, max_shared_prefixes=4), state_snapshots=3)
    second = assemble(pools, EngineConfig(max_concurrency=2, max_shared_prefixes=4), state_snapshots=3)
    assert first.prefix is not None and second.prefix is first.prefix is pools.pages.cache
    assert second.manager.state.max_snapshots == 3
    off = assemble(pools, EngineConfig(max_concurrency=2, max_shared_prefixes=0), state_snapshots=3)
    assert off.prefix is None and pools.pages.cache is None and off.manager.state.max_snapshots == 0
