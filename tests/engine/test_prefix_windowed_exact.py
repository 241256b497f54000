"""Prefix reuse is exact for windowed sequences: a windowed request that starts from a reused prefix (GPU prefix-cache
pages, host prefix-store pages, a plain request's copied partial page) computes the same logits as the same request
sent cold, for float and quantized KV.

The oracle is the cold request on an engine without prefix reuse. Each request is teacher-forced: the prompt ends
with a fixed answer, and the logits of every position the warm request computes (the answer's included) are
compared with the cold request's logits at the same positions. Window 128 and retrieval of 2 pages over prompts of
~900 tokens, so Quest selection chooses among many pages at every step."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from engine.engine import Engine
from engine.memory.attention import AttentionMemory
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import our_model, tiny_hf_model, wait_idle

PAGE = 64
WINDOW, RETRIEVE, CHUNK = 128, 128, 128


@pytest.fixture(autouse=True)
def checked_admissions(monkeypatch):
    """Every admission asserts the prefix cache's and the windowed table's invariants."""
    monkeypatch.setattr(AttentionMemory, "check_admissions", True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, folder = tiny_hf_model("llama", tmp_path_factory.mktemp("prefix-windowed-exact"), seed=5,
                              max_position_embeddings=4096)
    return our_model(folder)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def _engine(model, kv_dtype: str, *, reuse: bool, window=WINDOW, chunk=CHUNK, num_pages=48, host_pages=64,
            concurrency=1, **kw) -> Engine:
    dtype = torch.float32 if kv_dtype == "fp32" else kv_dtype
    runner = ModelRunner(model, num_pages, dtype, PAGE, host_pages=host_pages)
    return Engine(runner, max_concurrency=concurrency, prefill_chunk=chunk, max_context=4000, kv_window=window,
                  kv_retrieve=RETRIEVE, max_shared_prefixes=4 if reuse else 0, **kw).start()


@contextlib.contextmanager
def _all_logits(model):
    """Records the logits of every position each step computes ({position: logits}, one request at a time) while
    handing the engine only the rows it asked for."""
    seen: dict[int, torch.Tensor] = {}
    forward = model.forward

    def recording(batch, *more):  # more: the runner's interrupt of a prompt chunk
        rows, batch.logit_rows = batch.logit_rows, None
        out = forward(batch, *more)
        for pos, row in zip(batch.positions.tolist(), out):
            seen[pos] = row.clone()
        return out if rows is None else out.index_select(0, rows)

    model.forward = recording
    try:
        yield seen
    finally:
        del model.forward


def _send(engine: Engine, seen: dict, prompt: list[int], max_tokens=1, answer: list | None = None
          ) -> tuple[dict, dict]:
    """One greedy request; the logits of the positions it computed and the engine's stats after it (`answer`
    receives the generated tokens)."""
    seen.clear()
    out = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    if answer is not None:
        answer.extend(out)
    return dict(seen), wait_idle(engine)


def _assert_same_logits(warm: dict, cold: dict, answer_from: int) -> None:
    assert answer_from in warm, "the answer must be computed by the warm request"
    for pos in sorted(warm):
        torch.testing.assert_close(warm[pos], cold[pos], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, pos=pos: f"position {pos}: {m}")


def _cold(model, kv_dtype: str, prompt: list[int], max_tokens=1, **kw) -> dict:
    engine = _engine(model, kv_dtype, reuse=False, **kw)
    try:
        with _all_logits(model) as seen:
            got, stats = _send(engine, seen, prompt, max_tokens)
    finally:
        engine.shutdown()
    assert stats["prefix_hit_tokens"] == 0
    return got


# shared prefix lengths: shorter than the window, equal to it, longer (not a chunk multiple), a chunk multiple
HOST_CASES = [100, 128, 330, 512]


@pytest.mark.parametrize("kv_dtype", ["fp32", "k8v4"])
@pytest.mark.parametrize("shared", HOST_CASES)
def test_a_prefix_from_the_host_store_gives_the_cold_logits(tiny, kv_dtype, shared):
    """A windowed request leaves its pages in the host prefix store; a second one that shares `shared` tokens with
    it (then diverges, and ends with a fixed answer) computes the same logits as when sent cold."""
    base = _tokens(shared, seed=1)
    first = base + _tokens(900 - shared, seed=2)
    answer = _tokens(24, seed=3)
    second = base + _tokens(880 - shared, seed=4) + answer
    engine = _engine(tiny, kv_dtype, reuse=True)
    try:
        with _all_logits(tiny) as seen:
            _send(engine, seen, first)
            warm, stats = _send(engine, seen, second)
    finally:
        engine.shutdown()
    assert 0 < stats["prefix_host_hit_tokens"] == stats["prefix_hit_tokens"] <= shared
    _assert_same_logits(warm, _cold(tiny, kv_dtype, second), len(second) - len(answer))


@pytest.mark.parametrize("kv_dtype", ["fp32", "k8v4"])
def test_a_prompt_sent_again_and_a_follow_up_give_the_cold_logits(tiny, kv_dtype):
    """The same windowed prompt sent twice, then a follow-up (prompt + the generated answer + a new turn): the
    second and third requests reuse stored pages and compute the cold request's logits."""
    prompt = _tokens(700, seed=5)
    engine = _engine(tiny, kv_dtype, reuse=True)
    try:
        with _all_logits(tiny) as seen:
            _send(engine, seen, prompt, max_tokens=40)
            answer: list[int] = []
            again, again_stats = _send(engine, seen, prompt, max_tokens=40, answer=answer)
            follow = prompt + answer + _tokens(30, seed=6)
            warm, stats = _send(engine, seen, follow)
    finally:
        engine.shutdown()
    assert again_stats["prefix_hit_tokens"] > 0 and stats["prefix_hit_tokens"] > again_stats["prefix_hit_tokens"]
    _assert_same_logits(again, _cold(tiny, kv_dtype, prompt, max_tokens=40), len(prompt))
    _assert_same_logits(warm, _cold(tiny, kv_dtype, follow), len(follow) - 30)


@pytest.mark.parametrize("kv_dtype", ["fp32", "k8v4"])
@pytest.mark.parametrize("shared", [200, 383])
def test_a_prefix_from_the_gpu_prefix_cache_gives_the_cold_logits(tiny, kv_dtype, shared):
    """Window 384: a plain request (shorter than the window) is cached in the GPU prefix cache; a windowed request
    that starts with it copies those pages, and computes the same logits as when sent cold (chunk 96: 320 cached
    tokens end off a chunk boundary, where every step still attends to the whole context)."""
    base = _tokens(shared, seed=7)
    answer = _tokens(24, seed=8)
    long = base + _tokens(1100 - shared, seed=9) + answer
    kw = dict(window=384, chunk=96)
    engine = _engine(tiny, kv_dtype, reuse=True, **kw)
    try:
        with _all_logits(tiny) as seen:
            _send(engine, seen, base)
            warm, stats = _send(engine, seen, long)
    finally:
        engine.shutdown()
    assert stats["kv_windowed_sequences"] == 0 and stats["prefix_host_hit_tokens"] == 0
    assert stats["prefix_windowed_hit_tokens"] == stats["prefix_hit_tokens"] == shared // PAGE * PAGE
    _assert_same_logits(warm, _cold(tiny, kv_dtype, long, **kw), len(long) - len(answer))


@pytest.mark.parametrize("kv_dtype", ["fp32", "k8v4"])
def test_a_copied_partial_page_then_a_window_gives_the_cold_logits(tiny, kv_dtype):
    """A plain request leaves its partial last page cached; the next one starts with those tokens, copies the page,
    and decodes past the window (it turns windowed mid-decode, ring auto): every logit equals the cold request's.
    A windowed request over the same prefix (the tail cached, not copied) also gives the cold logits."""
    base = _tokens(100, seed=10)
    prompt = base + _tokens(10, seed=11)
    long = base + _tokens(800, seed=12)
    engine = _engine(tiny, kv_dtype, reuse=True)
    try:
        with _all_logits(tiny) as seen:
            _send(engine, seen, base)
            warm, stats = _send(engine, seen, prompt, max_tokens=200)
            _send(engine, seen, base)
            warm_long, _ = _send(engine, seen, long)
    finally:
        engine.shutdown()
    assert stats["prefix_partial_copies"] == 1 and stats["kv_evictions"] > 0
    _assert_same_logits(warm, _cold(tiny, kv_dtype, prompt, max_tokens=200), len(prompt))
    _assert_same_logits(warm_long, _cold(tiny, kv_dtype, long), len(long) - 1)


def _logprobs(engine: Engine, prompts: list[list[int]], n: int) -> list[list[tuple[int, float]]]:
    """Greedy (token, logprob) pairs of each prompt, all submitted at once."""
    from tests.engine.helpers import collect

    streams = [engine.submit(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))
               for p in prompts]
    out = []
    for stream in streams:
        pairs, last = [], None
        while last is None or not last.finished:
            last = stream.get(timeout=120)
            pairs += [(lp.token_id, lp.logprob) for lp in last.logprobs or []]
        out.append(pairs)
    return out


@pytest.mark.parametrize("kv_dtype", ["fp32", "k8v4"])
def test_concurrent_windowed_prompts_sharing_the_step_budget_give_their_cold_answers(tiny, kv_dtype):
    """Three windowed prompts (two sharing a stored prefix) submitted together share each step's prefill budget;
    each one's greedy tokens and their logprobs equal the same prompt's sent alone without reuse."""
    base = _tokens(300, seed=13)
    prompts = [base + _tokens(500, seed=14), _tokens(650, seed=15), base + _tokens(430, seed=16)]
    engine = _engine(tiny, kv_dtype, reuse=True, num_pages=96, host_pages=96, concurrency=3)
    try:
        engine.generate(base + _tokens(400, seed=17), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        got = _logprobs(engine, prompts, 8)
        stats = wait_idle(engine)
    finally:
        engine.shutdown()
    assert stats["prefix_host_hit_tokens"] > 0
    for prompt, pairs in zip(prompts, got):
        cold = _engine(tiny, kv_dtype, reuse=False)
        try:
            [want] = _logprobs(cold, [prompt], 8)
        finally:
            cold.shutdown()
        assert [t for t, _ in pairs] == [t for t, _ in want]
        torch.testing.assert_close([lp for _, lp in pairs], [lp for _, lp in want], rtol=1e-4, atol=1e-4)


def _stepped(model, kv_dtype: str) -> Engine:
    """An engine driven by step() in the test's thread, so that a failed check surfaces here."""
    dtype = torch.float32 if kv_dtype == "fp32" else kv_dtype
    return Engine(ModelRunner(model, 48, dtype, PAGE, host_pages=64), max_concurrency=1, prefill_chunk=CHUNK,
                  max_context=4000, kv_window=WINDOW, kv_retrieve=RETRIEVE, max_shared_prefixes=4)


def _run(engine: Engine, prompt: list[int]) -> None:
    engine.submit(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.step():
        pass


def test_the_admission_check_recomputes_summaries_and_compares_the_window_with_the_host(tiny):
    """The invariant check run after each admission fails on a stored page whose keys no longer match its Quest
    summary, and on a window page that differs from its host copy."""
    prompt = _tokens(700, seed=18)
    engine = _stepped(tiny, "k8v4")
    _run(engine, prompt)
    host = engine.runner.host
    stored = engine.memory.attention.host_prefix.match(prompt, 0, b"", 10)
    assert len(stored) == 10
    saved = host.kv.k[1][stored[3]].clone()
    host.kv.k[1][stored[3]] = saved.flip(0)  # page 3's keys of layer 1, tokens reversed: a different minimum
    with pytest.raises(AssertionError, match="Quest m"):
        _run(engine, prompt)
    host.kv.k[1][stored[3]] = saved

    engine = _stepped(tiny, "fp32")
    _run(engine, prompt)
    engine.submit(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()  # the admission (checked) and the first chunk
    [seq] = engine.scheduler.running
    table = seq.pages
    table.check(engine.runner.kv, seq.num_computed)
    engine.runner.kv.v[0][table.resident[9]].mul_(2)
    with pytest.raises(AssertionError, match="differs from host page"):
        table.check(engine.runner.kv, seq.num_computed)


def test_the_admission_check_refuses_a_windowed_reuse_off_a_chunk_boundary(tiny, monkeypatch):
    """Reusing every matched page (the behaviour before the chunk-boundary rule) fails the admission check."""
    from engine.memory.kv.window import Tiering

    monkeypatch.setattr(Tiering, "reuse_depth", lambda self, pages: pages)
    base = _tokens(330, seed=19)  # 5 pages: 320 tokens, neither a chunk boundary nor within the sink's reach
    engine = _stepped(tiny, "fp32")
    _run(engine, base + _tokens(600, seed=20))
    with pytest.raises(AssertionError, match="off a chunk boundary"):
        _run(engine, base + _tokens(600, seed=21))
