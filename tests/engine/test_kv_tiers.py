"""KV tiers: Quest page selection, the windowed (GPU window + host pages + retrieval) path against the full cache,
ring mode, page accounting, metrics and the refusals of combinations that cannot work."""
from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from engine.engine import ContextLengthError, Engine
from engine.errors import NInferError
from engine.memory.kv.summary import page_bounds, page_scores, page_summary, select_pages
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import collect, our_model, tiny_hf_model, wait_idle

PAGE = 64


# ---------------------------------------------------------------- selection (unit)

def test_page_scores_bound_every_key_of_the_page():
    """Quest: the score of a page is at least q . k for every key k of it, for every query head (GQA groups)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(8 * PAGE, 2, 16, generator=g)
    kmin, kmax = page_summary(keys, PAGE)
    for _ in range(20):
        q = torch.randn(1, 6, 16, generator=g)
        bounds = page_bounds(q, kmin, kmax)[:, 0]  # [pages, Hkv, G]
        dots = torch.einsum("hgd,nphd->nphg", q[0].view(2, 3, 16), keys.view(8, PAGE, 2, 16))
        assert torch.all(bounds >= dots.amax(dim=1) - 1e-5)
    # and it is tight for a page of identical keys
    same = torch.randn(1, 1, 16, generator=g).expand(PAGE, 1, 16)
    lo, hi = page_summary(same.contiguous(), PAGE)
    q = torch.randn(1, 1, 16, generator=g)
    assert page_bounds(q, lo, hi).item() == pytest.approx((q[0, 0] * same[0, 0]).sum().item(), rel=1e-5)


def test_page_scores_are_the_centred_bounds_computed_block_by_block():
    """The score is the page's bound minus the candidates' mean bound, maximised over rows and heads; scoring pages
    a block at a time (the mean comes from the mean summary) gives the same numbers."""
    g = torch.Generator().manual_seed(1)
    for n, rows in ((5, 1), (600, 3), (300, 64)):
        kmin = torch.randn(n, 3, 16, generator=g)
        kmax = kmin + torch.rand(n, 3, 16, generator=g)
        q = torch.randn(rows, 9, 16, generator=g)
        bounds = page_bounds(q, kmin, kmax)
        expected = (bounds - bounds.mean(0, keepdim=True)).amax(dim=(1, 2, 3))
        assert torch.allclose(page_scores(q, kmin, kmax, block=100), expected, atol=1e-4)


def _needle_case(seed: int, aligned: bool, lean: float = 3.0):
    """A context 16x the window (window 4 pages, 64 pages in all): random keys N(0, 1); the keys of one far page
    lean towards the query of one query head of one KV group (the other heads' queries are random): each of its
    keys gets `lean` times the query's direction added, which raises q . k by `lean` standard deviations."""
    g = torch.Generator().manual_seed(seed)
    hkv, groups, d, pages = 3, 3, 64, 64
    keys = torch.randn(pages * PAGE, hkv, d, generator=g)
    q = torch.randn(1, hkv * groups, d, generator=g)
    needle = int(torch.randint(1, pages - 4, (1,), generator=g))
    head = int(torch.randint(0, hkv, (1,), generator=g))
    qh = head * groups + int(torch.randint(0, groups, (1,), generator=g))
    direction = q[0, qh] / q[0, qh].norm()
    keys[needle * PAGE:(needle + 1) * PAGE, head] += lean * direction
    if not aligned:
        q = torch.randn(1, hkv * groups, d, generator=g)
    # candidates: pages 1 .. 59 (page 0 is the sink, the last 4 are the window)
    kmin, kmax = page_summary(keys, PAGE)
    chosen, _ = select_pages(q, kmin[1:pages - 4], kmax[1:pages - 4], 4)
    return needle, [c + 1 for c in chosen]


def test_selection_finds_the_needle_page_in_every_seed():
    found = [needle in chosen for needle, chosen in (_needle_case(seed, True) for seed in range(300))]
    assert all(found), f"missed the needle page in {found.count(False)} of 300 seeds"
    # the control: with a query that is not aligned with the needle, the same page is chosen far less often
    control = [needle in chosen for needle, chosen in (_needle_case(seed, False) for seed in range(300))]
    assert sum(control) < 0.25 * len(control)


def test_select_pages_returns_all_when_k_covers_them_and_none_for_k_zero():
    keys = torch.randn(3 * PAGE, 1, 8)
    kmin, kmax = page_summary(keys, PAGE)
    q = torch.randn(2, 2, 8)
    assert select_pages(q, kmin, kmax, 5)[0] == [0, 1, 2]
    assert select_pages(q, kmin, kmax, 0) == ([], [])
    chosen, scores = select_pages(q, kmin, kmax, 2)
    assert chosen == sorted(chosen) and len(scores) == 2
    assert min(scores) >= page_scores(q, kmin, kmax).sort().values[-2].item() - 1e-6


# ---------------------------------------------------------------- the windowed path on a tiny model

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, folder = tiny_hf_model("llama", tmp_path_factory.mktemp("tiers"), seed=3, max_position_embeddings=4096)
    return our_model(folder)


def _engine(model, *, num_pages=64, host_pages=0, kv_dtype=torch.float32, chunk=128, concurrency=2, **kw) -> Engine:
    runner = ModelRunner(model, num_pages, kv_dtype, PAGE, host_pages=host_pages)
    return Engine(runner, max_concurrency=concurrency, prefill_chunk=chunk, max_context=4000,
                  **{"max_shared_prefixes": 0, **kw}).start()


def _generate(engine: Engine, prompt, n=32) -> list[int]:
    try:
        return engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    finally:
        engine.shutdown()


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, "k8v4", "rk4v4"])
def test_window_with_retrieval_covering_the_context_equals_the_full_cache(tiny, kv_dtype):
    """Window 128 + retrieval of every older page: attention sees the whole context again (through host pages,
    per-layer selection and staging), so greedy output is the full cache's, for float and quantized KV."""
    prompt = _prompt(700)
    full = _generate(_engine(tiny, kv_dtype=kv_dtype), prompt)
    engine = _engine(tiny, kv_dtype=kv_dtype, num_pages=40, host_pages=64, kv_window=128, kv_retrieve=1024)
    stats_engine = engine
    tiered = _generate(engine, prompt)
    assert tiered == full
    s = stats_engine.stats()
    assert s["kv_retrieved_pages"] > 0 and s["kv_retrieved_bytes"] > 0 and s["kv_evictions"] > 0
    assert s["kv_writethrough_pages"] >= len(prompt) // PAGE


def test_ring_on_with_a_window_at_least_the_context_equals_the_full_cache(tiny):
    prompt = _prompt(500, seed=1)
    full = _generate(_engine(tiny), prompt)
    assert _generate(_engine(tiny, host_pages=32, kv_window=1024, kv_retrieve=64, kv_ring="on"), prompt) == full


def test_ring_auto_windows_a_sequence_that_outgrows_the_window_while_decoding(tiny):
    """The prompt fits the window; decoding past it switches the sequence to the windowed path mid-flight (with
    prefix reuse on, so its registered pages are copied, not rewritten)."""
    prompt = _prompt(200, seed=2)
    full = _generate(_engine(tiny), prompt, n=120)
    engine = _engine(tiny, num_pages=40, host_pages=32, kv_window=256, kv_retrieve=512, max_shared_prefixes=4)
    seen = []
    stream = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    tokens = []
    for out in stream:
        tokens += out.token_ids
        seen.append(engine.stats()["kv_windowed_sequences"])
    wait_idle(engine)
    s = engine.stats()
    engine.shutdown()
    assert tokens == full
    assert max(seen) == 1 and s["kv_host_pages_used"] == 0 and s["pages_free"] == 40
    assert s["prefix_cached_pages"] > 0  # its early pages stayed valid in the prefix cache
    # and the cached prefix still gives the same answer
    again = _engine(tiny, num_pages=40, host_pages=32, kv_window=256, kv_retrieve=512, max_shared_prefixes=4)
    assert _generate(again, prompt, n=120) == full


def test_lossy_window_is_refused_unless_allowed_and_then_reported(tiny, caplog):
    with pytest.raises(NInferError, match="--allow-lossy-window"):
        _engine(tiny, host_pages=32, kv_window=128)
    with caplog.at_level(logging.WARNING):
        engine = _engine(tiny, num_pages=40, host_pages=32, kv_window=128, allow_lossy_window=True)
    assert any("lossy" in r.getMessage() for r in caplog.records)
    s = engine.stats()
    engine.shutdown()
    assert s["kv_lossy"] is True and s["kv_retrieve_tokens"] == 0 and s["kv_window_tokens"] == 128


def test_bad_engine_combinations_name_their_remedy(tiny):
    cases = [
        (dict(kv_retrieve=64), "--kv-window"),
        (dict(kv_window=128, kv_retrieve=64), "--host-kv-mib"),
        (dict(num_pages=8, host_pages=32, kv_window=512, kv_retrieve=512), "Raise --kv-capacity"),
        (dict(host_pages=32, kv_window=128, kv_retrieve=64, speculator=_MTPLike()), "Use --spec ngram"),
        (dict(kv_window=128, kv_retrieve=64, kv_ring="off"), "--kv-retrieve 0"),
    ]
    for kw, remedy in cases:
        with pytest.raises(NInferError) as e:
            _engine(tiny, **kw)
        assert remedy in str(e.value), str(e.value)


class _MTPLike:
    needs_hidden = True  # what tells an MTP speculator apart: it drafts from the target's hidden states


@pytest.mark.parametrize("length, window, n", [(700, 128, 60), (200, 256, 220)])
def test_speculative_decoding_on_a_windowed_sequence_is_lossless(tiny, length, window, n):
    """ngram drafts verified on the windowed path (steps of several tokens, rejected tokens rolled back): greedy
    output equals the full cache's without speculation; also for a sequence that outgrows the window mid-decode."""
    from engine.speculative import Speculator
    from engine.speculative.ngram import NgramProposer

    base, motif = _prompt(length, seed=50), _prompt(6, seed=0)
    # a motif every 20 tokens: the proposer finds drafts, and the random model rejects some of them
    prompt = [tok for i in range(0, length, 20) for tok in (motif + base[i:i + 14])][:length]
    full = _generate(_engine(tiny), prompt, n=n)
    engine = _engine(tiny, num_pages=40, host_pages=64, kv_window=window, kv_retrieve=1024,
                     speculator=Speculator(NgramProposer(), 4))
    tokens = _generate(engine, prompt, n=n)
    s = engine.stats()
    assert tokens == full
    assert s["spec_steps"] > 0 and s["spec_drafted"] > s["spec_accepted"]  # verified and rolled back
    assert s["kv_retrieved_pages"] > 0 and s["pages_free"] == 40 and s["kv_host_pages_free"] == 64


def test_ring_off_refuses_a_prompt_beyond_the_window_saying_why(tiny):
    engine = _engine(tiny, kv_window=128, kv_ring="off")
    try:
        with pytest.raises(ContextLengthError) as e:
            engine.submit(_prompt(200), SamplingParams(temperature=0, max_tokens=4))
        assert "--kv-ring off" in str(e.value) and "127" in str(e.value)
        out = engine.generate(_prompt(100), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        assert len(out) == 28  # the window caps the sequence at 128 tokens: finish_reason length
    finally:
        engine.shutdown()


def test_a_prompt_beyond_the_gpu_pool_runs_through_the_host_tier(tiny):
    """The GPU pool (40 pages = 2560 tokens) cannot hold the 3000-token prompt; the host tier (50 pages = 3200
    tokens) can: the request is accepted, completes, and only a window + the retrieved pages were ever on the GPU.
    A prompt beyond the host tier is refused, saying so."""
    engine = _engine(tiny, num_pages=40, host_pages=50, kv_window=256, kv_retrieve=1536, chunk=256)
    try:
        with pytest.raises(ContextLengthError, match="host KV tier"):
            engine.submit(_prompt(3200), SamplingParams(max_tokens=1))
        tokens, last = collect(engine.submit(_prompt(3000, seed=5), SamplingParams(temperature=0, max_tokens=8,
                                                                                    ignore_eos=True)))
        s = wait_idle(engine)
    finally:
        engine.shutdown()
    assert len(tokens) == 8 and last.finish_reason == "length"
    # 3000 + 7 tokens had their KV computed; a page is written through before the step after it fills
    assert s["kv_writethrough_pages"] == 3006 // PAGE and s["kv_retrieved_pages"] > 0
    assert s["pages_free"] == 40 and s["kv_host_pages_free"] == 50


def test_page_counts_of_both_tiers_return_to_their_start_after_random_aborts(tiny):
    engine = _engine(tiny, num_pages=80, host_pages=48, kv_window=192, kv_retrieve=128, concurrency=3,
                     max_shared_prefixes=2)
    start = engine.stats()
    rng = random.Random(7)
    streams = []
    for i in range(14):
        prompt = _prompt(rng.choice([40, 150, 400, 700]), seed=100 + i)
        stream = engine.submit(prompt, SamplingParams(temperature=0.8, max_tokens=rng.randint(5, 60), seed=i))
        streams.append(stream)
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.05)
            engine.abort(stream.request_id)
    for stream in streams:
        collect(stream)
    s = wait_idle(engine)
    engine.shutdown()
    assert s["aborted"] > 0 and s["finished"] > 0
    assert s["pages_free"] == start["pages_free"] == 80
    assert s["kv_host_pages_free"] == start["kv_host_pages_free"] == 48 and s["kv_host_pages_used"] == 0
    assert s["kv_writethrough_pages"] > 0


def test_debug_log_has_a_kvmem_select_line_per_retrieval(tiny, caplog):
    engine = _engine(tiny, num_pages=40, host_pages=32, kv_window=128, kv_retrieve=128)
    with caplog.at_level(logging.DEBUG, logger="ninfer.kvmem"):
        _generate(engine, _prompt(400, seed=3), n=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "ninfer.kvmem"]
    assert any(line.startswith("kvmem select layer=1 pages=[") and "scores=[" in line for line in lines)
    assert len({line.split()[2] for line in lines}) == 2  # both layers select


def test_metrics_expose_the_kv_tiers(tiny):
    from engine.metrics import Metrics

    engine = _engine(tiny, num_pages=40, host_pages=32, kv_window=128, kv_retrieve=128)
    _generate(engine, _prompt(400, seed=4), n=4)
    metrics = Metrics()
    metrics.attach(engine)
    text = metrics.render()[0].decode()
    for name in ("ninfer_kv_host_pages_used", "ninfer_kv_host_pages_free", "ninfer_kv_retrieved_pages_total",
                 "ninfer_kv_retrieved_bytes_total", "ninfer_kv_evictions_total", "ninfer_kv_window_tokens",
                 "ninfer_kv_retrieve_mib_per_second", "ninfer_kv_retrieved_pages_per_step"):
        assert name in text, name
    assert "ninfer_kv_host_pages_free 32.0" in text
    snap, stats = metrics.snapshot(), engine.stats()
    assert snap["kv_retrieved_pages"] == stats["kv_retrieved_pages"] > 0
    assert snap["kv_retrieved_pages_per_step"] == pytest.approx(stats["kv_retrieved_pages"] / stats["steps"])
    assert snap["kv_retrieve_mib_per_second"] == pytest.approx(
        stats["kv_retrieved_bytes"] / 2**20 / stats["kv_retrieve_seconds"])


def test_ninfer_variables_reach_the_engine_config():
    """The settings the field reports could only set through the environment arrive in the EngineConfig that
    build_engine gets."""
    from engine.config.loading import load_settings
    from engine.config.engine_config import EngineConfig

    env = {"NINFER_KV_WINDOW": "16384", "NINFER_KV_RETRIEVE": "8192", "NINFER_KV_RING": "1",
           "NINFER_HOST_PAGEABLE": "1", "NINFER_HOST_KV_MIB": "8192"}
    settings, _ = load_settings([], env)
    c = EngineConfig.from_settings(settings)
    assert (c.kv_window, c.kv_retrieve, c.kv_ring, c.host_pageable, c.host_kv_mib, c.allow_lossy_window) == \
        (16384, 8192, "on", True, 8192, False)


def test_concurrent_windowed_and_plain_sequences_under_preemption_match_the_full_cache(tiny):
    """A GPU pool too small for all at once: windowed sequences (22-page footprints) and plain ones compete, get
    preempted and recomputed; with retrieval covering every older page each output is still the full cache's."""
    from tests.engine.helpers import run_concurrently

    prompts = [_prompt(n, seed=20 + i) for i, n in enumerate([700, 90, 450, 300, 60, 520])]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 80, 30, 50, 20, 35)]
    full = _engine(tiny, num_pages=96, concurrency=6)
    try:
        expected = [tokens for tokens, _ in run_concurrently(full, prompts, params)]
    finally:
        full.shutdown()
    engine = _engine(tiny, num_pages=30, host_pages=64, kv_window=128, kv_retrieve=1024, chunk=64, concurrency=4)
    try:
        got = [tokens for tokens, _ in run_concurrently(engine, prompts, params)]
        s = wait_idle(engine)
    finally:
        engine.shutdown()
    assert got == expected
    assert s["preemptions"] > 0 and s["kv_retrieved_pages"] > 0
    assert s["pages_free"] == 30 and s["kv_host_pages_free"] == 64


# ---------------------------------------------------------------- host-backed prefix reuse

def test_prefix_pages_evicted_from_the_gpu_come_back_from_the_host(tiny):
    """A 12-page GPU pool: prompt A (5 full pages) is cached, prompt B evicts A's pages (copied to the host store),
    and A again reuses them from the host: fewer prompt tokens computed, the same output as without any reuse."""
    a, b = _prompt(330, seed=30), _prompt(760, seed=31)
    plain = _engine(tiny, num_pages=16)
    try:
        want_a, want_b = plain.generate(a, _greedy(8)), plain.generate(b, _greedy(8))
    finally:
        plain.shutdown()
    engine = _engine(tiny, num_pages=12, host_pages=16, kv_reuse_hostbacked=True, max_shared_prefixes=4,
                     concurrency=1)
    try:
        assert engine.generate(a, _greedy(8)) == want_a
        assert engine.generate(b, _greedy(8)) == want_b
        before = wait_idle(engine)
        assert before["prefix_host_pages"] >= 5 and before["prefix_host_hits"] == 0
        assert engine.generate(a, _greedy(8)) == want_a
        s = wait_idle(engine)
    finally:
        engine.shutdown()
    assert s["prefix_host_hits"] == 1 and s["prefix_host_hit_tokens"] == 5 * PAGE
    assert s["prefill_tokens"] - before["prefill_tokens"] == len(a) - 5 * PAGE
    # stored prefix pages are idle: they count as free host pages, and none is held
    assert s["kv_host_pages_used"] == 0 and s["kv_host_pages_free"] == 16 and s["pages_free"] == 12


def test_stored_prefix_pages_give_way_to_windowed_sequences(tiny):
    """Host pages holding evicted prefixes are taken back (least recently used first) when a windowed sequence
    reserves its host pages; its output is still the full cache's."""
    prompt = _prompt(900, seed=33)
    full = _generate(_engine(tiny, num_pages=32), prompt, n=8)
    engine = _engine(tiny, num_pages=30, host_pages=16, kv_window=512, kv_retrieve=1024, chunk=64,
                     kv_reuse_hostbacked=True, max_shared_prefixes=8, concurrency=1)
    try:
        for seed in range(40, 45):  # within the window (plain, cached: 7 pages each); later ones evict earlier ones
            engine.generate(_prompt(400, seed=seed), _greedy(2))
        before = wait_idle(engine)
        assert before["prefix_host_pages"] > 0
        assert engine.generate(prompt, _greedy(8)) == full  # reserves 15 of the 16 host pages
        s = wait_idle(engine)
    finally:
        engine.shutdown()
    # its admission evicted more cached GPU pages to the host store, and took host pages back from the store; when
    # it ended, its own written-through pages (906 computed tokens: 14 pages) were stored as they are
    written = 906 // PAGE
    assert s["prefix_host_stored_pages"] - before["prefix_host_stored_pages"] > written
    assert written <= s["prefix_host_pages"] <= written + 16 - 15 and s["kv_host_pages_free"] == 16


def test_host_backed_reuse_needs_a_host_tier_and_prefix_reuse(tiny):
    with pytest.raises(NInferError, match="Set --host-kv-mib"):
        _engine(tiny, kv_reuse_hostbacked=True, max_shared_prefixes=4)
    with pytest.raises(NInferError, match="--max-shared-prefixes"):
        _engine(tiny, host_pages=8, kv_reuse_hostbacked=True, max_shared_prefixes=0)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
