"""The engine: concurrency and preemption do not change outputs, aborts return every page, seeds, stop reasons,
context limits."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from engine.engine import ContextLengthError, Engine
from engine.errors import NInferError
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import collect, consume_with_aborts, make_engine, make_runner, random_prompt, run_concurrently, wait_idle

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Books, which "
        "had been copied by hand for centuries, could now be produced quickly and cheaply. Within fifty years, "
        "presses were running in more than two hundred cities across Europe, and millions of volumes had been "
        "printed. The spread of printed material changed how people learned, argued and worshipped, and it helped "
        "to carry the ideas of the Renaissance, the Reformation and the Scientific Revolution far beyond the places "
        "where they first appeared.")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def default_prompts(tokenizer, lengths) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > max(lengths)
    return [ids[i:i + n] for i, n in enumerate(lengths)]


# ----- concurrency and preemption (the embedded model) -----

LENGTHS = [5, 41, 62, 110]  # 1 to 3 pages each by the end of 32 tokens


@pytest.fixture(scope="module")
def one_by_one(default_fp32_engine):
    """Prompts of different lengths and their greedy 32-token outputs, each run alone."""
    prompts = default_prompts(default_fp32_engine.tokenizer, LENGTHS)
    outputs = [default_fp32_engine.engine.generate(p, greedy(32)) for p in prompts]
    assert all(len(t) == 32 for t in outputs) and len({tuple(t) for t in outputs}) == 4
    return prompts, outputs


@pytest.mark.slow
def test_concurrent_requests_equal_sequential_ones(default_fp32_engine, one_by_one):
    engine = default_fp32_engine.engine
    prompts, sequential = one_by_one
    free = engine.pool.num_free
    concurrent = run_concurrently(engine, prompts, [greedy(32)] * 4)
    assert [tokens for tokens, _ in concurrent] == sequential
    assert all(last.finish_reason == "length" and last.completion_tokens == 32 for _, last in concurrent)
    wait_idle(engine)
    assert engine.pool.num_free == free


@pytest.mark.slow
def test_forced_preemption_keeps_outputs(default_fp32_engine, one_by_one):
    """The same four requests in a pool of four pages, where they need eight by the end: the scheduler must
    preempt and recompute, and the outputs stay those of the requests run one by one."""
    prompts, sequential = one_by_one
    runner = ModelRunner(default_fp32_engine.engine.runner.model, 4, torch.float32, 64)
    engine = Engine(runner, max_concurrency=4, prefill_chunk=512, max_context=256, max_shared_prefixes=0).start()
    try:
        concurrent = run_concurrently(engine, prompts, [greedy(32)] * 4)
        wait_idle(engine)
        assert engine.scheduler.preemptions > 0
        assert [tokens for tokens, _ in concurrent] == sequential
        assert all(last.finish_reason == "length" for _, last in concurrent)
        assert runner.pool.num_free == 4
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_eos_stops_with_reason_stop(default_fp32_engine):
    tok = default_fp32_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello."}])
    out, last = collect(default_fp32_engine.engine.submit(prompt, SamplingParams(temperature=0, max_tokens=64)))
    assert last.finish_reason == "stop"
    assert out[-1] in tok.eos_token_ids
    assert len(out) < 64
    assert last.completion_tokens == len(out)


@pytest.mark.slow
def test_seeds(default_fp32_engine):
    engine = default_fp32_engine.engine
    prompt = default_fp32_engine.tokenizer.encode("Once upon a time")

    def run(seed, **kw):
        return engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True, **kw))

    a = run(1234)
    assert run(1234) == a
    assert run(1235) != a
    assert run(None) != run(None)
    b = run(7, top_p=0.9, top_k=40)
    assert run(7, top_p=0.9, top_k=40) == b
    # a seeded request is reproducible while others share its batch
    results = run_concurrently(engine, [prompt] * 3, [SamplingParams(temperature=1.0, max_tokens=12, seed=s,
                                                                     ignore_eos=True) for s in (1234, 99, 1234)])
    assert results[0][0] == results[2][0] == a
    assert results[1][0] != a


@pytest.mark.slow
def test_prompt_at_max_context_is_rejected(default_fp32_engine):
    engine = default_fp32_engine.engine
    assert engine.max_context == 2048
    with pytest.raises(ContextLengthError, match="2048 tokens"):
        engine.submit([1] * 2048, greedy(1))
    with pytest.raises(ContextLengthError):
        engine.submit([1] * 5000, greedy(1))
    assert engine.stats()["waiting"] == 0


# ----- the same on a tiny random model (fast) -----


@pytest.fixture(scope="module")
def tiny_runner(tiny_models):
    return make_runner(tiny_models("llama")[1], num_pages=16)


@pytest.mark.usefixtures("one_thread")
def test_max_tokens_stops_with_reason_length(tiny_runner):
    engine = make_engine(tiny_runner)
    try:
        outs = []
        for n in (1, 2, 9):
            tokens, last = collect(engine.submit(list(range(10, 30)), greedy(n)))
            assert len(tokens) == n == last.completion_tokens
            assert last.finished and last.finish_reason == "length"
            assert last.prompt_tokens == 20
            outs.append(tokens)
        assert outs[1] == outs[2][:2] and outs[0] == outs[2][:1]
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("one_thread")
def test_counters_hold_a_step_before_its_outputs_reach_the_caller(tiny_runner, monkeypatch):
    """A client that reads the stats right after its request finished (the /metrics recent window) must see the
    request's tokens counted: the step is accounted before its outputs are pushed."""
    from engine.stream import RequestStream

    engine = make_engine(tiny_runner)
    seen = []
    push = RequestStream.push

    def recording_push(stream, out):
        if out.finished:  # runs on the engine thread, at the moment the caller could first see the end
            stats = engine.stats()
            seen.append((out.finish_reason, out.completion_tokens, stats["decode_tokens"], stats["prefill_tokens"],
                         stats["aborted"]))
        push(stream, out)

    monkeypatch.setattr(RequestStream, "push", recording_push)
    left = []  # (finished + aborted) as each sequence leaves the running list: it must count that sequence
    finish = engine.scheduler.finish

    def recording_finish(seq, reason):
        stats = engine.stats()
        left.append(stats["finished"] + stats["aborted"])
        finish(seq, reason)

    monkeypatch.setattr(engine.scheduler, "finish", recording_finish)
    try:
        for n in (1, 5):
            collect(engine.submit(list(range(10, 30)), greedy(n)))
        stream = engine.submit(list(range(10, 30)), greedy(100))
        next(iter(stream))
        engine.abort(stream.request_id)
        collect(stream)
    finally:
        engine.shutdown()
    # the first token comes from the prefill step; each later one from a decode step; an abort is counted too
    assert seen[:2] == [("length", 1, 0, 20, 0), ("length", 5, 4, 40, 0)]
    assert seen[2][0] == "abort" and seen[2][4] == 1
    assert left == [1, 2, 3]


@pytest.mark.usefixtures("one_thread")
def test_eos_and_stop_tokens_stop_with_reason_stop(tiny_runner):
    prompt = list(range(40, 70))
    engine = make_engine(tiny_runner)
    try:
        full = engine.generate(prompt, greedy(20))
    finally:
        engine.shutdown()
    stop = full[6]
    first = full.index(stop)
    engine = make_engine(tiny_runner, eos_ids={stop})
    try:
        tokens, last = collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=20)))
        assert tokens == full[:first + 1] and last.finish_reason == "stop"
        # ignore_eos ignores the model's EOS ...
        tokens, last = collect(engine.submit(prompt, greedy(20)))
        assert tokens == full and last.finish_reason == "length"
        # ... but not the request's own stop tokens
        tokens, last = collect(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                    stop_token_ids=(full[3],))))
        assert tokens == full[:full.index(full[3]) + 1] and last.finish_reason == "stop"
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("one_thread")
def test_context_limits(tiny_runner):
    engine = make_engine(tiny_runner, max_context=100)
    try:
        with pytest.raises(ContextLengthError, match="at most 99"):
            engine.submit(list(range(100)), greedy(5))
        # one token below the limit: room for exactly one answer token
        tokens, last = collect(engine.submit(list(range(99)), greedy(5)))
        assert len(tokens) == 1 and last.finish_reason == "length"
        # the context ends generation before max_tokens does
        tokens, last = collect(engine.submit(list(range(90)), greedy(50)))
        assert len(tokens) == 10 and last.finish_reason == "length"
        with pytest.raises(NInferError, match="empty"):
            engine.submit([], greedy(5))
        with pytest.raises(NInferError, match="temperature"):
            engine.submit([1, 2], SamplingParams(temperature=-1))
    finally:
        engine.shutdown()
    small = make_runner(tiny_runner.model, num_pages=2)  # KV capacity 128 tokens < max_context
    engine = make_engine(small, max_context=1024)
    try:
        with pytest.raises(ContextLengthError, match="KV cache capacity"):
            engine.submit(list(range(128)), greedy(1))
        tokens, last = collect(engine.submit(list(range(120)), greedy(50)))
        assert len(tokens) == 8 and last.finish_reason == "length"
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("one_thread")
def test_shutdown_ends_open_requests(tiny_runner):
    engine = make_engine(tiny_runner)
    stream = engine.submit(list(range(50)), greedy(900))
    stream.get(timeout=30)
    engine.shutdown()
    tokens, last = collect(stream, timeout=10)
    assert last.finished and last.finish_reason == "abort"
    assert tiny_runner.pool.num_free == tiny_runner.pool.num_pages


class _HookedRunner:
    """A runner that calls `before_step` on the engine thread before each forward pass."""

    def __init__(self, runner, before_step):
        self.runner, self.pools, self.pool, self.before_step = runner, runner.pools, runner.pool, before_step

    def run(self, works):
        self.before_step()
        return self.runner.run(works)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_random_aborts_return_every_page(tiny_runner):
    """100 requests (8 pages for prompts of up to 200 tokens, so admission waits and preemption can happen), a
    seeded random half of them aborted before they start, in the middle of their prefill, in the middle of
    decoding, or at a random time. Afterwards the engine is idle, every page is free again and the engine still
    answers as before."""
    rng = random.Random(20240611)
    runner = make_runner(tiny_runner.model, num_pages=8)
    probe = list(range(100, 140))
    engine: Engine | None = None
    mid_prefill: set[str] = set()
    aborted_in_prefill: list[str] = []

    def before_step():
        for seq in engine.scheduler.running:
            if seq.request_id in mid_prefill and 0 < seq.num_computed < len(seq.prompt):
                mid_prefill.discard(seq.request_id)
                aborted_in_prefill.append(seq.request_id)
                engine.abort(seq.request_id)

    room = {"max_queue": 128}  # all 100 may wait
    engine = Engine(_HookedRunner(runner, before_step), max_concurrency=4, prefill_chunk=16,
                    max_context=640, **{"max_shared_prefixes": 0, **room}).start()
    try:
        reference = engine.generate(probe, greedy(8))
        start_free = runner.pool.num_free
        assert start_free == 8
        results: dict[str, tuple] = {}
        modes: dict[str, str] = {}
        limits: dict[str, int] = {}
        failures: dict[str, str] = {}
        threads = []

        def consume(stream, mode, after_tokens, delay):
            consume_with_aborts(stream, mode, after_tokens, delay, results, failures)

        for i in range(100):
            mode = rng.choice(["none", "none", "before_start", "mid_prefill", "mid_decode", "random_time"])
            n_prompt = rng.randint(50, 200) if mode == "mid_prefill" else rng.randint(1, 200)
            if rng.random() < 0.5:  # decoding crosses into a new page soon: the pool may run dry there
                n_prompt = max(64 * rng.randint(1, 3) - rng.randint(0, 6), 1)
            max_tokens = rng.randint(2, 12)
            params = (greedy(max_tokens) if rng.random() < 0.5 else
                      SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, seed=i, ignore_eos=True))
            rid = f"req-{i}"
            modes[rid], limits[rid] = mode, max_tokens
            if mode == "mid_prefill":
                mid_prefill.add(rid)
            stream = engine.submit(random_prompt(np.random.default_rng(i), 512, n_prompt), params, request_id=rid)
            if mode == "before_start":
                stream.abort()
            t = threading.Thread(target=consume, args=(stream, mode, rng.randint(1, max_tokens - 1),
                                                       rng.uniform(0, 0.03)))
            t.start()
            threads.append(t)
            time.sleep(rng.uniform(0, 0.004))
        for t in threads:
            t.join(90)
        if len(results) != 100:
            state = [(q.request_id, q.status.value, len(q.prompt), len(q.output), q.num_computed, len(q.pages))
                     for q in [*engine.scheduler.running, *engine.scheduler.waiting]]
            pytest.fail(f"{100 - len(results)} requests never finished: {failures}; modes "
                        f"{ {r: modes[r] for r in failures} }; engine {engine.stats()}; sequences {state}")
        stats = wait_idle(engine)
        assert runner.pool.num_free == start_free
        assert stats["pages_free"] == start_free and stats["running"] == 0 and stats["waiting"] == 0

        reasons = {rid: last.finish_reason for rid, (_, last) in results.items()}
        assert set(reasons.values()) <= {"abort", "length"}
        for rid, mode in modes.items():
            tokens, last = results[rid]
            if mode == "none":
                assert reasons[rid] == "length" and len(tokens) == last.completion_tokens
            assert len(tokens) == last.completion_tokens <= limits[rid]
            if reasons[rid] == "abort":
                assert len(tokens) < limits[rid]
        by_mode = {m: [r for r in modes if modes[r] == m and reasons[r] == "abort"] for m in set(modes.values())}
        assert by_mode["before_start"] and by_mode["mid_decode"] and by_mode["random_time"]
        assert aborted_in_prefill and all(reasons[r] == "abort" and results[r][1].completion_tokens == 0
                                          for r in aborted_in_prefill)
        assert any(results[r][1].completion_tokens > 0 for r in by_mode["mid_decode"])
        assert engine.counters["aborted"] == list(reasons.values()).count("abort")
        assert engine.generate(probe, greedy(8)) == reference
        assert runner.pool.num_free == start_free
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("one_thread")
def test_step_runs_the_engine_on_the_calling_thread_only_when_its_thread_is_stopped(tiny_runner):
    engine = make_engine(tiny_runner)
    try:
        with pytest.raises(RuntimeError, match="thread is not running"):
            engine.step()
        threaded = engine.generate(list(range(10, 30)), greedy(5))
    finally:
        engine.shutdown()
    stream = engine.submit(list(range(10, 30)), greedy(5))
    steps = 1
    while engine.step():
        steps += 1
    tokens, last = collect(stream)
    assert tokens == threaded and last.finish_reason == "length" and steps == 5  # one prefill, four decode steps
