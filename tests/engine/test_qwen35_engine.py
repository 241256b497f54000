"""The engine's scheduling on a Qwen3.5-class hybrid itself (not the stand-in recurrent model of
test_memory_seam.py): sequences preempted for lack of pages are recomputed with the same output as transformers
generates, and 200 requests aborted at random leave the KV pool and the state pool whole."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.engine import Engine
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import abort_storm, run_concurrently, wait_idle
from tests.engine.qwen35_models import VOCAB

PAGE = 64


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen35):
    return tiny_qwen35(seed=1)


@pytest.fixture(scope="module")
def model(checkpoint):
    return build_model(load_weights(checkpoint[1])[1], torch.float32, torch.device("cpu"))


def engine_over(model, *, num_pages: int, state_slots: int, snapshots: int = 0, prefix: int = 0) -> Engine:
    runner = ModelRunner(model, num_pages, torch.float32, PAGE, state_slots=state_slots, max_batch=4)
    return Engine(runner, max_concurrency=4, prefill_chunk=512, max_context=num_pages * PAGE,
                  max_shared_prefixes=prefix, state_snapshots=snapshots).start()


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_preemption_and_recompute_match_transformers(model, checkpoint):
    """Four sequences that outgrow a 6-page pool: some are preempted (pages and state slot released) and recomputed
    from their tokens; every answer is what transformers generates."""
    hf, _ = checkpoint
    engine = engine_over(model, num_pages=6, state_slots=4)
    try:
        prompts = [tokens(30 + i, 40 + 3 * i) for i in range(4)]
        results = run_concurrently(engine, prompts, [greedy(48)] * 4)
        assert engine.stats()["preemptions"] > 0
        for p, (out, _) in zip(prompts, results):
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=48, min_new_tokens=48)
            assert out == ref[0, len(p):].tolist()
        idle = wait_idle(engine)
        assert idle["pages_free"] == 6 and idle["state_slots_free"] == 4
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_random_aborts_leave_both_pools_whole(model):
    """200 requests (prefix reuse and state snapshots on), a third aborted at a random time, a third after a few
    tokens: afterwards every page and state slot is free and the host snapshots stay within their bound; a request
    sent after the storm still answers as on a fresh engine."""
    engine = engine_over(model, num_pages=12, state_slots=4, snapshots=2, prefix=4)
    try:
        idle = abort_storm(engine, lambda i, rng: tokens(100 + i % 13, rng.randint(5, 140)),
                           lambda rng: greedy(rng.randint(1, 12)), seed=11)
        assert idle["aborted"] > 20
        assert idle["pages_free"] == idle["pages_total"] == 12
        assert idle["state_slots_free"] == engine.runner.state.num_free == 4
        assert idle["state_snapshot_host_bytes"] <= 2 * idle["state_slot_bytes"]
        after = run_concurrently(engine, [tokens(7, 50)], [greedy(16)])[0][0]
    finally:
        engine.shutdown()
    fresh = engine_over(model, num_pages=12, state_slots=4)
    try:
        assert after == run_concurrently(fresh, [tokens(7, 50)], [greedy(16)])[0][0]
    finally:
        fresh.shutdown()
