"""Automatic prefix reuse: cached full pages are shared by later requests with the same prefix. Outputs never
change, a re-sent long prompt skips its prefill, cached pages never cause a refusal, --max-shared-prefixes bounds
them, and after many requests with random aborts every page is accounted for."""
from __future__ import annotations

import logging
import random
import threading
import time

import numpy as np
import pytest
import torch

from engine.engine import Engine
from engine.memory.kv import prefix as prefix_mod
from engine.memory.kv.pages import PagePool
from engine.memory.kv.prefix import PrefixCache, resolve_max_shared_prefixes
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import PAGE, collect, consume_with_aborts, our_model, random_prompt, run_concurrently, wait_idle

VOCAB = 512  # the tiny models' vocabulary


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


class CheckedRunner:
    """A runner that checks, before every forward pass, that the step writes KV only into pages its sequence holds
    alone and that are not cached (so sharing needs no copy-on-write), that every page it reads is held, and the
    cache's own invariants. Violations are collected (an exception would only fail the step)."""

    def __init__(self, runner: ModelRunner, before_step=None):
        self.runner, self.pools, self.pool, self.kv = runner, runner.pools, runner.pool, runner.kv
        self.before_step = before_step
        self.violations: list[str] = []
        self.steps = 0

    def run(self, works):
        if self.before_step is not None:
            self.before_step()
        pool, cache = self.pool, self.pool.cache
        for w in works:
            end = w.start + len(w.tokens)
            for page in {w.pages[pos // PAGE] for pos in range(w.start, end)}:
                if pool.refcount(page) != 1 or (cache is not None and cache.is_cached(page)):
                    self.violations.append(f"step {self.steps}: write into page {page} (refs "
                                           f"{pool.refcount(page)}, cached {cache is not None and cache.is_cached(page)})")
            for page in w.pages[:-(-end // PAGE)]:
                if pool.refcount(page) < 1:
                    self.violations.append(f"step {self.steps}: read of unheld page {page}")
        if cache is not None:
            try:
                cache.check()
            except AssertionError as e:
                self.violations.append(f"step {self.steps}: cache invariant: {e!r}")
        self.steps += 1
        return self.runner.run(works)


def make(model, num_pages: int, bound, *, max_concurrency: int = 4, prefill_chunk: int = 512,
         max_context: int | None = None, max_queue: int = 64, before_step=None) -> tuple[Engine, CheckedRunner]:
    runner = CheckedRunner(ModelRunner(model, num_pages, torch.float32, PAGE), before_step)
    engine = Engine(runner, max_concurrency=max_concurrency, prefill_chunk=prefill_chunk,
                    max_context=max_context or num_pages * PAGE, max_shared_prefixes=bound, max_queue=max_queue)
    return engine.start(), runner


def assert_idle_and_whole(engine: Engine, runner: CheckedRunner) -> dict:
    stats = wait_idle(engine)
    pool = runner.pool
    assert runner.violations == []
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
    assert pool.num_unused + pool.num_cached == pool.num_free == pool.num_pages
    assert stats["pages_free"] == stats["pages_total"] == pool.num_pages
    if pool.cache is not None:
        pool.cache.check()
        assert pool.cache.num_pages == pool.num_cached  # every cached page is idle
        assert not pool.cache._progress and not engine.scheduler._readmit
    return stats


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return our_model(tiny_models("llama")[1])


# ----- the pool and the cache, directly -----

def test_pool_counts_idle_cached_pages_as_free_and_evicts_lru_leaves_first():
    pool = PagePool(6, 4)
    cache = PrefixCache(pool, max_chains=8)

    class Seq:  # what the cache reads of a sequence
        def __init__(self, tokens):
            self.tokens, self.num_computed, self.pages, self.request_id = tokens, 0, [], "s"

    a = Seq(list(range(12)))  # three full pages
    a.pages = pool.allocate(3)
    cache.admitted(a, [])
    a.num_computed = 12
    cache.register(a)
    assert cache.num_pages == 3 and cache.num_chains == 1 and pool.num_free == 3
    b = Seq(list(range(100, 108)))
    b.pages = pool.allocate(2)
    cache.admitted(b, [])
    b.num_computed = 8
    cache.register(b)
    assert cache.num_chains == 2
    pool.deallocate(a.pages)
    cache.forget(a)
    pool.deallocate(b.pages)
    cache.forget(b)
    assert pool.num_free == 6 and pool.num_unused == 1 and pool.num_cached == 5
    cache.check()
    # a match is capped below the last token, and needs the exact tokens
    assert [e.page for e in cache.match(list(range(12)))] == a.pages[:2]
    assert [e.page for e in cache.match(list(range(13)))] == a.pages
    assert [e.page for e in cache.match([0, 1, 2, 3, 9, 9, 9, 9, 9])] == a.pages[:1]
    # allocating takes the free page, then a's tail (released before b's pages), then its middle page
    got = pool.allocate(3)
    assert got[1:] == [a.pages[2], a.pages[1]] and cache.evicted_pages == 2
    assert [e.page for e in cache.match(list(range(13)))] == a.pages[:1]
    cache.check()
    pool.deallocate(got)
    assert pool.num_free == 6


def test_a_key_collision_never_serves_other_tokens(monkeypatch):
    monkeypatch.setattr(prefix_mod, "page_key", lambda parent, tokens: b"same")  # every page collides
    pool = PagePool(4, 4)
    cache = PrefixCache(pool, max_chains=8)

    class Seq:
        def __init__(self, tokens):
            self.tokens, self.num_computed, self.pages, self.request_id = tokens, 0, [], "s"

    a = Seq([1, 2, 3, 4, 5])
    a.pages = pool.allocate(2)
    cache.admitted(a, [])
    a.num_computed = 5
    cache.register(a)
    assert cache.num_pages == 1
    assert cache.match([9, 9, 9, 9, 9]) == []  # same key, other tokens: a miss
    assert [e.page for e in cache.match([1, 2, 3, 4, 5])] == a.pages[:1]
    b = Seq([7, 7, 7, 7, 8])
    b.pages = pool.allocate(2)
    cache.admitted(b, [])
    b.num_computed = 5
    cache.register(b)  # collides: b's page is not cached, and a's stays as it was
    assert cache.num_pages == 1 and not cache.is_cached(b.pages[0])
    for s in (a, b):
        pool.deallocate(s.pages)
        cache.forget(s)
    assert pool.num_free == 4 and pool.num_cached == 1
    cache.check()


def test_max_shared_prefixes_auto_and_off():
    assert resolve_max_shared_prefixes("auto", 4) == 8 and resolve_max_shared_prefixes("auto", 12) == 12
    assert resolve_max_shared_prefixes(0, 4) == 0 and resolve_max_shared_prefixes(3, 4) == 3
    pool = PagePool(4, 64)
    assert PrefixCache.for_pool(pool, 0) is None and pool.cache is None
    cache = PrefixCache.for_pool(pool, 5)
    assert pool.cache is cache and PrefixCache.for_pool(pool, 2) is cache and cache.max_chains == 2
    assert PrefixCache.for_pool(pool, 0) is None and pool.cache is None and pool.num_free == 4


# ----- outputs with reuse == outputs without -----

def scenarios(engine: Engine, rng: np.random.Generator, n_out: int, vocab: int, make_prompt=None) -> list:
    """Runs the same request patterns on any engine; returns every output and the prefix-hit tokens of each phase.
    Every prompt (and user turn) starts with a token no other one starts with, so no two share a prefix by chance."""
    first = iter(range(2, vocab))
    make_prompt = make_prompt or (lambda n: [next(first)] + random_prompt(rng, vocab, n - 1))
    out, hits = [], []

    def phase(prompts, concurrent=False):
        before = engine.stats()["prefix_hit_tokens"]
        if concurrent:
            out.append([tokens for tokens, _ in run_concurrently(engine, prompts, [greedy(n_out)] * len(prompts))])
        else:
            out.append([engine.generate(p, greedy(n_out)) for p in prompts])
        wait_idle(engine)
        hits.append(engine.stats()["prefix_hit_tokens"] - before)

    same = make_prompt(150)
    phase([same])
    phase([same])  # the same prompt twice: 128 tokens shared + 21 copied from its tail page (all but the last)
    system = make_prompt(140)
    # a shared system prompt, different user turns: the later two share 128 and copy the system's 12 tokens past it
    phase([system + make_prompt(k) for k in (12, 30, 49)])
    exact = make_prompt(128)
    phase([exact])
    phase([exact])  # an exact multiple of 64: page 0 shared, 63 tokens of page 1 copied (its last token computed)
    phase([exact + make_prompt(64)])  # ... and now both pages are shared (the one with the old last token too)
    one_page = make_prompt(64)
    phase([one_page, one_page])  # a one-page prompt: 63 tokens copied from the first one's page
    shared = make_prompt(130)
    phase([shared + make_prompt(k) for k in (5, 20, 40, 70)], concurrent=True)  # concurrent, sharing a prefix
    phase([shared + make_prompt(k) for k in (6, 21, 41, 71)], concurrent=True)  # 128 shared + 2 copied each
    twin = make_prompt(200)
    phase([twin] * 3, concurrent=True)  # identical prompts at once: computed together, cached once
    phase([twin] * 2, concurrent=True)  # 192 shared + 7 copied each
    return out, hits


EXPECTED_HITS = [0, 149, 2 * 140, 0, 127, 128, 63, None, 4 * 130, None, 2 * 199]  # None: timing decides


@pytest.mark.usefixtures("one_thread")
def test_outputs_with_reuse_equal_outputs_without_tiny(tiny):
    results = {}
    for bound in (0, "auto"):
        engine, runner = make(tiny, 32, bound)
        try:
            results[bound] = scenarios(engine, np.random.default_rng(7), 12, VOCAB)
            stats = assert_idle_and_whole(engine, runner)
        finally:
            engine.shutdown()
        if bound == 0:
            assert stats["prefix_cached_pages"] == 0 and stats["pages_cached"] == 0
    (plain, plain_hits), (reused, hits) = results[0], results["auto"]
    assert plain_hits == [0] * len(plain_hits)
    assert reused == plain
    for got, want in zip(hits, EXPECTED_HITS):
        assert got == want or want is None, (hits, EXPECTED_HITS)
    assert stats["prefix_hit_tokens"] == sum(hits) > 0 and 0 < stats["prefix_hit_ratio"] < 1


@pytest.mark.slow
def test_outputs_with_reuse_equal_outputs_without_default_model(default_fp32_engine):
    model, tok = default_fp32_engine.engine.runner.model, default_fp32_engine.tokenizer
    from tests.engine.test_engine import TEXT
    words = tok.encode(" ".join([TEXT] * 3))
    results = {}
    for bound in (0, "auto"):
        engine, runner = make(model, 64, bound, max_context=2048)
        rng = np.random.default_rng(11)
        count = iter(range(1000))

        def prompt(n, rng=rng, count=count):  # real text from a random place, after a header no other prompt has
            head = [1000 + next(count)] + tok.encode(" Request:")  # (nor starts with: no common prefix by chance)
            start = int(rng.integers(0, len(words) - n))
            return (head + words[start:])[:n]
        try:
            results[bound] = scenarios(engine, rng, 6, 0, prompt)
            assert_idle_and_whole(engine, runner)
        finally:
            engine.shutdown()
    (plain, _), (reused, hits) = results[0], results["auto"]
    assert reused == plain
    for got, want in zip(hits, EXPECTED_HITS):
        assert got == want or want is None, (hits, EXPECTED_HITS)


# ----- a byte-identical long prompt again -----

@pytest.mark.slow
def test_long_prompt_sent_again_reuses_its_prefix_and_answers_fast(default_fp32_engine, caplog):
    model, tok = default_fp32_engine.engine.runner.model, default_fp32_engine.tokenizer
    from tests.engine.test_engine import TEXT
    prompt = tok.encode(" ".join(f"Part {i}. {TEXT}" for i in range(12)))[:1300]
    assert len(prompt) == 1300
    engine, runner = make(model, 40, "auto", max_context=2048)

    def ttft_and_tokens():
        t0 = time.perf_counter()
        stream = engine.submit(prompt, greedy(4))
        first = stream.get(timeout=300)
        ttft = time.perf_counter() - t0
        tokens, last = collect(stream, timeout=300)
        return ttft, first.token_ids + tokens

    try:
        engine.generate(tok.encode("Warm up the threads."), greedy(2))
        cold, cold_out = ttft_and_tokens()
        before = engine.stats()
        with caplog.at_level(logging.DEBUG, logger="ninfer.scheduler"):
            warm, warm_out = ttft_and_tokens()
        stats = assert_idle_and_whole(engine, runner)
    finally:
        engine.shutdown()
    hit = stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    print(f"\nlong prompt: hit {hit}/{len(prompt)} prompt tokens ({hit / len(prompt):.2%}); TTFT cold {cold:.3f} s, "
          f"warm {warm:.3f} s ({warm / cold:.1%})")
    # 1280 tokens in 20 shared pages, 19 copied from the cached partial page: all but the last token (computed)
    assert hit == len(prompt) - 1 and hit >= 0.999 * len(prompt)
    assert stats["prefix_partial_copies"] == 1 and stats["prefix_partial_tokens"] == len(prompt) - 1 - 1280
    assert warm_out == cold_out
    assert warm < 0.5 * cold
    assert any("prefix hit" in r.getMessage() and f"reuses {hit} of {len(prompt)}" in r.getMessage()
               for r in caplog.records)


@pytest.mark.usefixtures("one_thread")
def test_preemption_with_shared_pages_keeps_outputs(tiny):
    """Four prompts sharing a 100-token prefix, each ending just before a page boundary, in a pool of six pages:
    decoding runs the pool dry, sequences holding shared pages are preempted and recomputed (reusing what is still
    cached), and every output is that of the prompt run alone without reuse."""
    rng = np.random.default_rng(21)
    system = random_prompt(rng, VOCAB, 100)
    prompts = [system + random_prompt(rng, VOCAB, n) for n in (27, 25, 22, 26)]
    plain = make_plain(tiny, 6)
    try:
        alone = [plain.generate(p, greedy(30)) for p in prompts]
        engine, runner = make(tiny, 6, "auto")
        try:
            together = run_concurrently(engine, prompts, [greedy(30)] * 4)
            stats = assert_idle_and_whole(engine, runner)
        finally:
            engine.shutdown()
    finally:
        while _plain:
            _plain.pop().shutdown()
    assert [tokens for tokens, _ in together] == alone
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    print(f"\npreemption test: {stats['preemptions']} preemptions, {stats['prefix_hit_tokens']} prompt tokens and "
          f"{stats['prefix_recompute_hit_tokens']} recomputed tokens served from the cache")


# ----- cached prefixes never cause a refusal -----

@pytest.mark.usefixtures("one_thread")
def test_long_request_after_an_idle_long_one_evicts_it_instead_of_waiting(tiny):
    engine, runner = make(tiny, 8, "auto")  # 512 tokens: the two prompts (5 and 7 pages) cannot be held at once
    try:
        rng = np.random.default_rng(3)
        first = random_prompt(rng, VOCAB, 300)
        tokens, last = collect(engine.submit(first, greedy(4)))
        assert last.finish_reason == "length"
        idle = assert_idle_and_whole(engine, runner)
        # 303 computed tokens: four full pages and a tail of 47
        assert idle["pages_cached"] == 5 == idle["prefix_cached_pages"] and idle["prefix_tail_pages"] == 1
        second = random_prompt(rng, VOCAB, 420)
        tokens, last = collect(engine.submit(second, greedy(8)), timeout=60)
        assert last.finish_reason == "length" and len(tokens) == 8
        stats = assert_idle_and_whole(engine, runner)
        # 7 pages needed, 3 free: the tail (released first, the least recently used) and 3 full pages are evicted
        assert stats["prefix_evicted_pages"] == 4 and stats["preemptions"] == 0
        # the first prompt's surviving pages (if any) still serve a correct answer
        again, _ = collect(engine.submit(first, greedy(4)))
        assert again == collect(make_plain(tiny, 8).submit(first, greedy(4)))[0]
    finally:
        engine.shutdown()
        while _plain:
            _plain.pop().shutdown()


_plain: list[Engine] = []


def make_plain(model, num_pages: int) -> Engine:
    engine, _ = make(model, num_pages, 0)
    _plain.append(engine)
    return engine


# ----- the bound on cached prefixes -----

@pytest.mark.usefixtures("one_thread")
def test_max_shared_prefixes_bounds_the_cached_chains(tiny):
    engine, runner = make(tiny, 32, 2)
    try:
        rng = np.random.default_rng(5)
        prompts = [random_prompt(rng, VOCAB, 200 + 10 * i) for i in range(5)]
        outs = []
        for p in prompts:
            tokens, last = collect(engine.submit(p, greedy(3)))
            assert last.finish_reason == "length"
            outs.append(tokens)
            stats = assert_idle_and_whole(engine, runner)
            assert stats["prefix_chains"] <= 2
        # each prompt leaves 3 full pages and a tail (202 + 10 i computed tokens), one chain: two chains are kept
        assert stats["prefix_chains"] == 2 and stats["prefix_cached_pages"] == 4 + 4
        assert stats["prefix_tail_pages"] == 2 and stats["prefix_evicted_pages"] == 3 * 4
        # the two most recent still hit (all but the last token), the oldest no longer does
        for p, want_hit in ((prompts[4], len(prompts[4]) - 1), (prompts[3], len(prompts[3]) - 1), (prompts[0], 0)):
            before = engine.stats()["prefix_hit_tokens"]
            assert collect(engine.submit(p, greedy(3)))[0] == outs[prompts.index(p)]
            assert engine.stats()["prefix_hit_tokens"] - before == want_hit
            assert assert_idle_and_whole(engine, runner)["prefix_chains"] <= 2
        # five at once, with a bound of two: all answered, and the bound holds again when idle
        results = run_concurrently(engine, [p + [1] for p in prompts], [greedy(3)] * 5)
        assert all(last.finish_reason == "length" for _, last in results)
        assert assert_idle_and_whole(engine, runner)["prefix_chains"] <= 2
    finally:
        engine.shutdown()


# ----- many requests with random aborts -----

@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_thousand_requests_with_random_aborts_leave_every_page_accounted_for(tiny):
    rng = random.Random(987)
    nrng = np.random.default_rng(987)
    engine: Engine | None = None
    mid_prefill: set[str] = set()

    def before_step():
        for seq in engine.scheduler.running:
            if seq.request_id in mid_prefill and 0 < seq.num_computed < len(seq.prompt):
                mid_prefill.discard(seq.request_id)
                engine.abort(seq.request_id)

    engine, runner = make(tiny, 10, "auto", max_concurrency=6, prefill_chunk=48, max_context=640, max_queue=128,
                          before_step=before_step)
    systems = [random_prompt(nrng, VOCAB, n) for n in (64, 100, 140, 190)]
    sent: list[list[int]] = []
    results: dict[str, tuple] = {}
    failures: dict[str, str] = {}
    modes: dict[str, str] = {}

    def consume(stream, mode, after_tokens, delay):
        consume_with_aborts(stream, mode, after_tokens, delay, results, failures, timeout=120)

    try:
        for wave in range(25):
            threads = []
            for j in range(40):
                i = wave * 40 + j
                kind = rng.choice(["shared", "shared", "repeat", "unshared"])
                if kind == "repeat" and sent:
                    prompt = rng.choice(sent)
                elif kind == "unshared":
                    n = rng.choice([rng.randint(1, 220), 64 * rng.randint(1, 4) - rng.randint(0, 5)])
                    prompt = random_prompt(nrng, VOCAB, n)
                else:
                    system = rng.choice(systems)
                    n = rng.randint(0, 90)
                    if rng.random() < 0.5:  # ends just before a page boundary: decoding soon needs a new page
                        n = max(64 * (len(system) // 64 + rng.randint(1, 2)) - rng.randint(0, 5) - len(system), 0)
                    prompt = system + random_prompt(nrng, VOCAB, n)
                sent.append(prompt)
                mode = rng.choice(["none", "none", "none", "before_start", "mid_prefill", "mid_decode", "random_time"])
                max_tokens = rng.randint(2, 10)
                params = (greedy(max_tokens) if rng.random() < 0.6 else
                          SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=i, ignore_eos=True))
                rid = f"r{i}"
                modes[rid] = mode
                if mode == "mid_prefill":
                    mid_prefill.add(rid)
                stream = engine.submit(prompt, params, request_id=rid)
                if mode == "before_start":
                    stream.abort()
                t = threading.Thread(target=consume, args=(stream, mode, rng.randint(1, max_tokens - 1),
                                                           rng.uniform(0, 0.02)))
                t.start()
                threads.append(t)
                time.sleep(rng.uniform(0, 0.002))
            for t in threads:
                t.join(180)
        assert not failures and len(results) == 1000, failures
        stats = assert_idle_and_whole(engine, runner)
        reasons = [last.finish_reason for _, last in results.values()]
        assert set(reasons) <= {"abort", "length"} and reasons.count("abort") >= 200
        assert all(results[r][1].finish_reason == "length" for r, m in modes.items() if m == "none")
        assert stats["prefix_hit_tokens"] > 0 and stats["prefix_hits"] > 100 and stats["preemptions"] > 0
        assert stats["prefix_evicted_pages"] > 0 and stats["prefix_partial_copies"] > 100
        print(f"\n1000 requests: {stats['prefix_hits']} hits, {stats['prefix_hit_tokens']}/"
              f"{stats['prefix_prompt_tokens']} prompt tokens reused ({stats['prefix_partial_copies']} partial-page "
              f"copies), {stats['prefix_evicted_pages']} pages evicted, "
              f"{stats['preemptions']} preemptions, {stats['pages_cached']} pages cached now")
        # cached pages are still valid: a re-sent prompt hits and answers as an engine without reuse
        plain = make_plain(tiny, 10)
        probes = [systems[2] + [5, 6, 7], systems[3] + list(range(30, 90))]
        for p in probes:
            engine.generate(p, greedy(6))
        for p in probes:
            before = engine.stats()["prefix_hit_tokens"]
            assert engine.generate(p, greedy(6)) == plain.generate(p, greedy(6))
            assert engine.stats()["prefix_hit_tokens"] - before == len(p) - 1  # full pages + the copied tail
        assert_idle_and_whole(engine, runner)
    finally:
        engine.shutdown()
        while _plain:
            _plain.pop().shutdown()


# ----- metrics -----

@pytest.mark.usefixtures("one_thread")
def test_prefix_metrics_are_exported(tiny):
    from engine.metrics import Metrics

    engine, runner = make(tiny, 16, "auto")
    metrics = Metrics()
    try:
        metrics.attach(engine)
        p = random_prompt(np.random.default_rng(9), VOCAB, 200)
        engine.generate(p, greedy(2))
        engine.generate(p, greedy(2))
        assert_idle_and_whole(engine, runner)
        text = metrics.render()[0].decode()
        snap = metrics.snapshot()
    finally:
        engine.shutdown()
    # the second request: 3 full pages shared + 7 tokens copied from the first one's tail page (201 computed)
    assert "ninfer_prefix_hit_tokens_total 199.0" in text and "ninfer_prefix_prompt_tokens_total 400.0" in text
    assert "ninfer_prefix_hits_total 1.0" in text and "ninfer_prefix_hit_ratio 0.4975" in text
    assert "ninfer_kv_pages_cached 4.0" in text and "ninfer_prefix_cached_chains 1.0" in text
    assert "ninfer_kv_pages_free 16.0" in text and "ninfer_kv_pages_used 0.0" in text
    assert snap["prefix_hit_tokens"] == 199 and snap["pages_cached"] == 4 and snap["pages_used"] == 0
