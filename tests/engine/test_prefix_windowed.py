"""Prefix reuse for windowed sequences (KV tiers): a windowed sequence starts from cached full pages (GPU prefix
cache pages copied to its host pages and its window, host prefix store pages taken over), and leaves its
written-through pages in the host prefix store when it ends. Greedy outputs equal the same engine's without prefix
reuse, Quest selection sees the reused pages, and both tiers' page counts return to their start."""
from __future__ import annotations

import random
import time

import pytest
import torch

from engine.engine import Engine
from engine.memory.attention import AttentionMemory
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import collect, our_model, tiny_hf_model, wait_idle

PAGE = 64


@pytest.fixture(autouse=True)
def checked_admissions(monkeypatch):
    """Every admission asserts the prefix cache's and the windowed table's invariants."""
    monkeypatch.setattr(AttentionMemory, "check_admissions", True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, folder = tiny_hf_model("llama", tmp_path_factory.mktemp("prefix-windowed"), seed=3,
                              max_position_embeddings=4096)
    return our_model(folder)


def _engine(model, *, reuse: bool, num_pages=40, host_pages=64, chunk=128, concurrency=2, **kw) -> Engine:
    runner = ModelRunner(model, num_pages, torch.float32, PAGE, host_pages=host_pages)
    return Engine(runner, max_concurrency=concurrency, prefill_chunk=chunk, max_context=4000,
                  max_shared_prefixes=4 if reuse else 0, **kw).start()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _sends(engine: Engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[dict]]:
    """Each prompt in turn; the outputs and the engine's stats after each."""
    outs, stats = [], []
    for p in prompts:
        outs.append(engine.generate(p, _greedy(n)))
        stats.append(wait_idle(engine))
    return outs, stats


@pytest.mark.parametrize("kv_dtype", ["fp32", "k8v4"])
def test_a_windowed_prompt_sent_again_starts_from_its_stored_pages(tiny, kv_dtype):
    """Window 128, retrieval of 4 pages out of ~10 older ones (selection matters): the second send takes the first
    one's 10 pages of whole 128-token chunks over from the host store and computes only the rest; a follow-up
    reuses the same 10 (the answer's page was computed by decode steps, which a cold prefill does not reproduce);
    every output equals the same engine's without reuse."""
    import torch

    dtype = torch.float32 if kv_dtype == "fp32" else kv_dtype
    prompt = _prompt(700, seed=1)
    outs = {}
    for reuse in (False, True):
        runner = ModelRunner(tiny, 40, dtype, PAGE, host_pages=64)
        engine = Engine(runner, max_concurrency=2, prefill_chunk=128, max_context=4000,
                        max_shared_prefixes=4 if reuse else 0, kv_window=128, kv_retrieve=256).start()
        try:
            outs[reuse], stats = _sends(engine, [prompt, prompt], 12)
            follow = prompt + outs[reuse][0] + [7, 8, 9]  # a follow-up: prompt + answer + more
            more, more_stats = _sends(engine, [follow], 12)
            outs[reuse] += more
            stats += more_stats
        finally:
            engine.shutdown()
        last = stats[-1]
        assert last["pages_free"] == 40 and last["kv_host_pages_free"] == 64 and last["kv_host_pages_used"] == 0
        if reuse:
            # 700 + 11 computed tokens, 11 pages written through: the 10 of the five whole chunks are stored, and
            # page 10 (a partial chunk, then decode steps) is not
            first, second, third = stats
            assert first["prefix_hit_tokens"] == 0 and first["prefix_host_pages"] == 10
            assert second["prefix_hit_tokens"] == 640 and second["prefix_windowed_hit_tokens"] == 640
            assert second["prefill_tokens"] - first["prefill_tokens"] == 700 - 640
            assert second["prefix_host_hit_tokens"] == 640 and second["prefix_host_pages"] == 10
            assert third["prefix_hit_tokens"] - second["prefix_hit_tokens"] == 10 * PAGE
            assert third["prefix_windowed_hit_tokens"] - second["prefix_windowed_hit_tokens"] == 10 * PAGE
            assert third["kv_retrieved_pages"] > 0
        else:
            assert stats[-1]["prefix_hit_tokens"] == 0 and stats[-1]["prefix_host_pages"] == 0
    assert outs[True] == outs[False]
    assert outs[True][0] == outs[True][1]


def test_a_windowed_prompt_starts_from_pages_a_plain_one_cached_on_the_gpu(tiny):
    """Window 384: a 300-token prompt runs plain and is cached in the GPU prefix cache; a 900-token prompt that starts
    with it runs windowed and copies those 4 full pages (to its host pages, with their Quest summaries, and to its
    sink and window); its output equals the same engine's without reuse."""
    base = _prompt(300, seed=2)
    long = base + _prompt(600, seed=3)
    outs = {}
    for reuse in (False, True):
        engine = _engine(tiny, reuse=reuse, kv_window=384, kv_retrieve=256)
        try:
            outs[reuse], stats = _sends(engine, [base, long], 10)
        finally:
            engine.shutdown()
        assert stats[-1]["pages_free"] == 40 and stats[-1]["kv_host_pages_free"] == 64
        if reuse:
            assert stats[0]["kv_windowed_sequences"] == 0 and stats[0]["prefix_cached_pages"] >= 4
            assert stats[1]["prefix_windowed_hit_tokens"] == 4 * PAGE == stats[1]["prefix_hit_tokens"]
            assert stats[1]["prefix_host_hit_tokens"] == 0
    assert outs[True] == outs[False]


def test_page_counts_of_both_tiers_return_to_their_start_after_random_aborts_with_windowed_reuse(tiny):
    """Windowed and plain requests over three shared long prefixes, concurrent, a third aborted at a random time, in
    GPU and host pools too small for all at once (preemption, stored pages giving way): afterwards every page of
    both tiers is free again, windowed requests reused stored pages, and re-sent prompts answer as without reuse."""
    bases = [_prompt(n, seed=10 + i) for i, n in enumerate((200, 450, 700))]
    engine = _engine(tiny, reuse=True, num_pages=60, host_pages=40, kv_window=192, kv_retrieve=128, chunk=64,
                     concurrency=3)
    rng = random.Random(4)
    sent = []
    try:
        start = engine.stats()
        streams = []
        for i in range(30):
            prompt = rng.choice(bases) + _prompt(rng.randint(0, 90), seed=100 + i)
            sent.append(prompt)
            stream = engine.submit(prompt, SamplingParams(temperature=0.8, max_tokens=rng.randint(3, 30), seed=i))
            streams.append(stream)
            if rng.random() < 0.35:
                time.sleep(rng.random() * 0.05)
                engine.abort(stream.request_id)
        for stream in streams:
            collect(stream, timeout=120)
        s = wait_idle(engine, timeout=60)
        probes = [bases[2] + [5, 6, 7], bases[1] + [9]]
        got = [engine.generate(p, _greedy(6)) for p in probes]
        end = wait_idle(engine)
    finally:
        engine.shutdown()
    assert s["aborted"] > 0 and s["finished"] > 0
    for stats in (s, end):
        assert stats["pages_free"] == start["pages_free"] == 60
        assert stats["kv_host_pages_free"] == start["kv_host_pages_free"] == 40 and stats["kv_host_pages_used"] == 0
    assert s["prefix_windowed_hit_tokens"] > 0 and s["prefix_host_hits"] > 0
    plain = _engine(tiny, reuse=False, num_pages=60, host_pages=40, kv_window=192, kv_retrieve=128, chunk=64)
    try:
        assert got == [plain.generate(p, _greedy(6)) for p in probes]
    finally:
        plain.shutdown()


@pytest.mark.slow
def test_a_windowed_long_prompt_sent_again_reuses_most_of_it_default_model(default_fp32_engine):
    """SmolLM2, --kv-window 512 --kv-retrieve 512, prefill chunk 512: a 1,500-token prompt sent twice reuses its
    two whole chunks (1,024 tokens, 68%; reuse stops at a chunk boundary) the second time, and both greedy answers
    equal the same engine's without prefix reuse."""
    from tests.engine.test_engine import TEXT

    model, tok = default_fp32_engine.engine.runner.model, default_fp32_engine.tokenizer
    prompt = tok.encode(" ".join(f"Part {i}. {TEXT}" for i in range(14)))[:1500]
    assert len(prompt) == 1500
    outs = {}
    for reuse in (False, True):
        runner = ModelRunner(model, 40, default_fp32_engine.engine.runner.kv.kv_dtype, PAGE, host_pages=64)
        engine = Engine(runner, max_concurrency=1, prefill_chunk=512, max_context=4096, kv_window=512,
                        kv_retrieve=512, max_shared_prefixes="auto" if reuse else 0).start()
        try:
            outs[reuse], stats = _sends(engine, [prompt, prompt], 8)
        finally:
            engine.shutdown()
        second = stats[1]
        assert second["pages_free"] == 40 and second["kv_host_pages_free"] == 64
        hit = second["prefix_hit_tokens"] - stats[0]["prefix_hit_tokens"]
        assert hit == (1024 if reuse else 0) and second["kv_retrieved_pages"] > 0
    assert outs[True] == outs[False] and outs[True][0] == outs[True][1]
