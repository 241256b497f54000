"""Prefix reuse of partial pages (copy on write): a sequence that releases its pages leaves its partial last page as
a cached "tail"; a later prompt copies the cached page sharing the longest token prefix with it into its own page.
A byte-identical prompt sent again reuses all but its last token, a chat follow-up reuses the answer, outputs never
change, and every page is accounted for after aborts, preemption and speculative rejections."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from engine.memory.kv import prefix as prefix_mod
from engine.memory.kv.pages import PagePool
from engine.memory.kv.prefix import PrefixCache
from engine.sampling import SamplingParams
from tests.engine.helpers import consume_with_aborts, our_model, random_prompt, wait_idle
from tests.engine.test_prefix import VOCAB, assert_idle_and_whole, greedy, make

P = 4  # page size of the unit tests


class Seq:  # what the cache reads of a sequence
    def __init__(self, tokens, computed=None):
        self.tokens, self.num_computed, self.pages, self.request_id = list(tokens), 0, [], "s"
        self.computed = len(self.tokens) if computed is None else computed


def run_and_release(pool: PagePool, cache: PrefixCache, tokens, computed=None) -> Seq:
    """Admits a sequence as the scheduler does (full hits shared), computes it, releases it keeping its tail."""
    seq = Seq(tokens, computed)
    hits = cache.match(seq.tokens)
    pool.share([e.page for e in hits])
    seq.pages = [e.page for e in hits] + pool.allocate(pool.pages_for(len(seq.tokens)) - len(hits))
    cache.admitted(seq, hits)
    seq.num_computed = seq.computed
    cache.register(seq)
    cache.keep_tail(seq)
    pool.deallocate(seq.pages)
    cache.forget(seq)
    cache.check()
    return seq


def partial(cache: PrefixCache, tokens) -> tuple[int | None, int]:
    hits = cache.match(tokens)
    entry, n = cache.match_partial(tokens, hits)
    return len(hits), (entry.page if entry is not None else None), n


# ----- the cache, directly -----

def test_a_released_partial_page_is_a_tail_matched_by_longest_common_prefix_and_capped():
    pool = PagePool(16, P)
    cache = PrefixCache(pool, max_chains=8)
    a = run_and_release(pool, cache, [1, 2, 3, 4, 5, 6, 7])  # one full page + a tail of 3
    assert cache.num_pages == 2 and cache.num_tails == 1 and cache.num_chains == 1 and pool.num_cached == 2
    tail = a.pages[1]
    # the same prompt: page 0 shared, then the tail copied up to the cap (the last token is always computed)
    assert partial(cache, [1, 2, 3, 4, 5, 6, 7]) == (1, tail, 2)
    assert partial(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == (1, tail, 3)  # longer: all three tokens
    assert partial(cache, [1, 2, 3, 4, 5, 9, 9]) == (1, tail, 1)  # common prefix only
    assert partial(cache, [1, 2, 3, 4, 9, 9]) == (1, None, 0)
    assert partial(cache, [1, 2, 3, 4, 5]) == (1, None, 0)  # cap: 4 tokens at most, all in the shared page
    # a full page matching in part (or lying past the cap) is copied the same way
    assert partial(cache, [1, 2, 3, 9]) == (0, a.pages[0], 3)
    assert partial(cache, [1, 2, 3, 4]) == (0, a.pages[0], 3)
    assert partial(cache, [7, 2, 3, 4]) == (0, None, 0)
    # among several tails under one parent, the longest common prefix wins
    b = run_and_release(pool, cache, [1, 2, 3, 4, 5, 8])
    assert cache.num_tails == 2 and cache.num_chains == 2
    assert partial(cache, [1, 2, 3, 4, 5, 8, 0]) == (1, b.pages[1], 2)
    assert partial(cache, [1, 2, 3, 4, 5, 6, 0]) == (1, tail, 2)
    cache.check()


def test_tails_add_tokens_or_are_not_kept():
    pool = PagePool(16, P)
    cache = PrefixCache(pool, max_chains=8)
    a = run_and_release(pool, cache, [1, 2, 3, 4, 5, 6])
    short = run_and_release(pool, cache, [1, 2, 3, 4, 5])  # a prefix of a's tail: not kept, its page is free
    assert cache.num_tails == 1 and not cache.is_cached(short.pages[1]) and pool.num_unused == 16 - 2
    longer = run_and_release(pool, cache, [1, 2, 3, 4, 5, 6, 7])  # extends a's tail: replaces it
    assert cache.num_tails == 1 and cache.is_cached(longer.pages[1]) and not cache.is_cached(a.pages[1])
    assert partial(cache, [1, 2, 3, 4, 5, 6, 7, 0]) == (1, longer.pages[1], 3)
    run_and_release(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # a full page covering the tail: the tail goes
    assert cache.num_tails == 1 and not cache.is_cached(longer.pages[1]) and cache.num_pages == 3
    assert pool.num_unused + pool.num_cached == 16 and cache.num_chains == 1
    # a sequence whose computed tokens end on a page boundary leaves no tail; one computed less than its tokens
    # leaves only its computed ones (generated tokens whose KV is not there yet are never cached)
    run_and_release(pool, cache, [5, 5, 5, 5])
    assert cache.num_tails == 1
    s = run_and_release(pool, cache, [6, 6, 6, 6, 6, 6, 6], computed=5)
    assert cache.num_tails == 2 and partial(cache, [6] * 8) == (1, s.pages[1], 1)
    cache.check()


def test_tails_count_as_chains_are_evicted_first_and_never_go_to_the_host_store():
    pool = PagePool(6, P)
    cache = PrefixCache(pool, max_chains=2)
    stored = []

    class Backing:
        def store(self, entry):
            stored.append(entry.tokens)

    cache.backing = Backing()
    a = run_and_release(pool, cache, [1, 2, 3, 4, 5])
    b = run_and_release(pool, cache, [2, 2, 2, 2, 2, 2])
    assert cache.num_chains == 2 and cache.num_pages == 4
    c = run_and_release(pool, cache, [3, 3])  # a root tail: a third chain, the least recently used one goes
    assert cache.num_chains == 2 and not cache.is_cached(a.pages[0]) and not cache.is_cached(a.pages[1])
    assert stored == [(1, 2, 3, 4)]  # a's full page went to the host store, its tail did not
    # room: the tail of the least recently used chain is evicted before its parent page
    got = pool.allocate(pool.num_unused + 1)
    assert b.pages[1] in got and cache.is_cached(b.pages[0]) and cache.num_tails == 1
    assert stored == [(1, 2, 3, 4)] and cache.evicted_pages == 3
    pool.deallocate(got)
    assert partial(cache, [3, 3, 3]) == (0, c.pages[0], 2)
    cache.check()


def test_a_key_collision_never_serves_a_tail_of_other_tokens(monkeypatch):
    monkeypatch.setattr(prefix_mod, "page_key", lambda parent, tokens: b"same")  # every full page collides
    pool = PagePool(8, P)
    cache = PrefixCache(pool, max_chains=8)
    a = run_and_release(pool, cache, [1, 2, 3, 4, 5, 6])
    b = run_and_release(pool, cache, [9, 9, 9, 9, 5, 6])  # collides with a's page: b caches nothing at all
    assert cache.num_pages == 2 and not cache.is_cached(b.pages[0]) and not cache.is_cached(b.pages[1])
    # b's tokens after a page of other tokens never reach a's tail: the tail hangs under a's verified page
    assert partial(cache, [9, 9, 9, 9, 5, 6, 0]) == (0, None, 0)
    assert partial(cache, [1, 2, 3, 4, 5, 6, 0]) == (1, a.pages[1], 2)
    cache.check()


# ----- the engine, on the tiny model -----

@pytest.fixture(scope="module")
def tiny(tiny_models):
    return our_model(tiny_models("llama")[1])


@pytest.mark.usefixtures("one_thread")
def test_a_follow_up_reuses_the_answer_and_outputs_equal_an_engine_without_reuse(tiny):
    rng = np.random.default_rng(40)
    first = random_prompt(rng, VOCAB, 100)
    plain, _ = make(tiny, 16, 0)
    engine, runner = make(tiny, 16, "auto")
    try:
        answer = engine.generate(first, greedy(20))
        assert answer == plain.generate(first, greedy(20))
        # prompt + answer + a new turn: all computed tokens of the first request (100 + 19) are reused
        follow = first + answer + random_prompt(rng, VOCAB, 30)
        before = engine.stats()
        assert engine.generate(follow, greedy(10)) == plain.generate(follow, greedy(10))
        stats = assert_idle_and_whole(engine, runner)
        assert stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == len(first) + len(answer) - 1
        assert stats["prefix_partial_copies"] - before["prefix_partial_copies"] == 1
        assert stats["prefix_partial_tokens"] - before["prefix_partial_tokens"] == 119 - 64
        # and the same follow-up again: all but its last token
        before = stats
        assert engine.generate(follow, greedy(10)) == plain.generate(follow, greedy(10))
        stats = assert_idle_and_whole(engine, runner)
        assert stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == len(follow) - 1
    finally:
        engine.shutdown()
        plain.shutdown()


@pytest.mark.usefixtures("one_thread")
def test_aborts_preemption_and_speculative_rejections_keep_every_page_and_every_output(tiny):
    """In a 10-page pool: first four 190-token prompts queued before the engine starts (each needs a fourth page
    while decoding: preemption, and re-admission copies the preempted one's tail), then 200 requests over a few
    shared prefixes and repeats, with ngram drafts that the random model mostly rejects (pages shrink), about half
    aborted at random points: page counts return to their start, the cache's invariants hold before every step, and
    the greedy requests that ran to the end answer as an engine without reuse and without speculation."""
    from engine.engine import Engine
    from engine.runner import ModelRunner
    from engine.speculative import Speculator
    from engine.speculative.ngram import NgramProposer
    from tests.engine.test_prefix import CheckedRunner

    rng, nrng = random.Random(5), np.random.default_rng(5)
    motif = random_prompt(nrng, VOCAB, 5)
    systems = [[t for i in range(n // 8) for t in motif[:3] + random_prompt(nrng, VOCAB, 5)] for n in (60, 100, 150)]
    runner = CheckedRunner(ModelRunner(tiny, 10, torch.float32, 64))
    engine = Engine(runner, max_concurrency=4, prefill_chunk=48, max_context=640, max_shared_prefixes="auto",
                    max_queue=256, speculator=Speculator(NgramProposer(), 3))
    results, failures, modes, prompts, sent = {}, {}, {}, {}, []
    try:
        threads = []
        for i in range(4):  # queued before the engine starts: they run together, whatever the machine's load
            rid, prompt = f"p{i}", random_prompt(nrng, VOCAB, 190)
            modes[rid], prompts[rid] = "none", prompt
            stream = engine.submit(prompt, greedy(20), request_id=rid)
            threads.append(threading.Thread(target=consume_with_aborts, args=(stream, "none", 0, 0, results,
                                                                               failures, 120)))
        engine.start()
        for t in threads:
            t.start()
        for i in range(200):
            if sent and rng.random() < 0.3:
                prompt = rng.choice(sent)
            else:
                prompt = rng.choice(systems) + random_prompt(nrng, VOCAB, rng.randint(1, 70))
            sent.append(prompt)
            mode = rng.choice(["none", "none", "mid_decode", "random_time"])
            rid = f"t{i}"
            modes[rid], prompts[rid] = mode, prompt
            stream = engine.submit(prompt, greedy(rng.randint(3, 12)), request_id=rid)
            t = threading.Thread(target=consume_with_aborts, args=(stream, mode, 2, rng.uniform(0, 0.05), results,
                                                                    failures, 120))
            t.start()
            threads.append(t)
            time.sleep(rng.uniform(0, 0.005))
        for t in threads:
            t.join(240)
        assert not failures and len(results) == 204, failures
        stats = assert_idle_and_whole(engine, runner)
    finally:
        engine.shutdown()
    assert stats["preemptions"] > 0 and stats["prefix_partial_copies"] > 20 and stats["aborted"] > 20
    assert stats["spec_drafted"] > stats["spec_accepted"]  # rejections happened
    plain, _ = make(tiny, 16, 0)
    try:
        done = [r for r, m in modes.items() if m == "none" and results[r][1].finish_reason == "length"]
        for rid in done[:25]:
            tokens, _ = results[rid]
            assert tokens == plain.generate(prompts[rid], greedy(len(tokens))), rid
    finally:
        plain.shutdown()


# ----- the default model -----

@pytest.mark.slow
def test_a_long_prompt_sent_again_reuses_all_but_its_last_token_default_model(default_fp32_engine):
    """SmolLM2: a 1,500-token prompt sent twice reuses 1,499 tokens the second time (99.93%), and both greedy
    answers equal an engine's without prefix reuse; a follow-up (prompt + answer + a question) reuses the answer."""
    model, tok = default_fp32_engine.engine.runner.model, default_fp32_engine.tokenizer
    from tests.engine.test_engine import TEXT
    prompt = tok.encode(" ".join(f"Part {i}. {TEXT}" for i in range(14)))[:1500]
    assert len(prompt) == 1500
    plain, _ = make(model, 40, 0, max_context=2048)
    try:
        want = plain.generate(prompt, greedy(8))
    finally:
        plain.shutdown()
    engine, runner = make(model, 40, "auto", max_context=2048)
    try:
        assert engine.generate(prompt, greedy(8)) == want
        before = wait_idle(engine)
        assert engine.generate(prompt, greedy(8)) == want
        stats = assert_idle_and_whole(engine, runner)
        hit = stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        assert hit == len(prompt) - 1 and hit / len(prompt) >= 0.999
        follow = prompt + want + tok.encode(" Summarize this in one line.")
        before = stats
        got = engine.generate(follow, greedy(4))
        stats = assert_idle_and_whole(engine, runner)
        assert stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == len(prompt) + len(want) - 1
    finally:
        engine.shutdown()
    plain, _ = make(model, 40, 0, max_context=2048)
    try:
        assert got == plain.generate(follow, greedy(4))
    finally:
        plain.shutdown()
