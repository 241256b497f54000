"""How unsure page retrieval is: the share of the Quest bound mass a selection leaves on the host, per selection
(engine/memory/kv/summary.py: outside_share), in Engine.stats() (kv_select_outside_mass, kv_select_outside_mass_now), in
/metrics and in the `kvmem select` debug line."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from engine.engine import Engine
from engine.memory.kv.summary import outside_share, page_scores, select_pages
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import our_model, tiny_hf_model, wait_idle

PAGE = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, folder = tiny_hf_model("llama", tmp_path_factory.mktemp("select-signal"), seed=6, max_position_embeddings=4096)
    return our_model(folder)


def _engine(model, retrieve: int) -> Engine:
    runner = ModelRunner(model, 40, torch.float32, PAGE, host_pages=32)
    return Engine(runner, max_concurrency=1, prefill_chunk=128, max_context=4000, kv_window=128,
                  kv_retrieve=retrieve).start()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def test_the_outside_share_is_the_softmax_mass_of_the_pages_left_out():
    """Against its definition: equal scores leave (n - k) / n outside; one page far above the others, chosen,
    leaves almost nothing; every page chosen leaves nothing."""
    assert outside_share(torch.zeros(8), torch.tensor([1, 5]), 16) == pytest.approx(6 / 8)
    scores = torch.tensor([0.0, 0.0, 400.0, 0.0])
    assert outside_share(scores, torch.tensor([2]), 16) < 1e-6
    assert outside_share(scores, torch.tensor([0]), 16) > 0.999
    assert outside_share(scores, torch.arange(4), 16) == 0.0
    q = torch.randn(3, 4, 16)
    kmin, kmax = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    kmin, kmax = torch.minimum(kmin, kmax), torch.maximum(kmin, kmax)
    chosen, scores, outside = select_pages(q, kmin, kmax, 4, mass=True)
    weights = torch.softmax(page_scores(q, kmin, kmax) / 4.0, 0)
    assert outside == pytest.approx(1 - weights[chosen].sum().item(), abs=1e-6)
    assert select_pages(q, kmin, kmax, 4) == (chosen, scores)
    assert select_pages(q, kmin, kmax, 10, mass=True)[2] == 0.0


def test_stats_metrics_and_the_debug_line_report_the_share_left_on_the_host(tiny, caplog):
    """Window 128 over a 600-token prompt: retrieving 2 pages of 6+ leaves some bound mass on the host (reported
    in the stats, /metrics and each `kvmem select` line); retrieving as many pages as the context has leaves
    none."""
    from engine.metrics import Metrics

    prompt = _prompt(600, seed=1)
    shares = {}
    for retrieve in (128, 640):
        engine = _engine(tiny, retrieve)
        metrics = Metrics()
        try:
            metrics.attach(engine)
            with caplog.at_level(logging.DEBUG, logger="ninfer.kvmem"):
                stream = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                first = stream.get(timeout=60)  # the first token: the sequence runs, its latest step selected
                now = engine.stats()["kv_select_outside_mass_now"]
                while not first.finished:
                    first = stream.get(timeout=60)
                stats = wait_idle(engine)
            text = metrics.render()[0].decode()
        finally:
            engine.shutdown()
        shares[retrieve] = (stats["kv_select_outside_mass"], now)
        assert f"ninfer_kv_select_outside_mass {stats['kv_select_outside_mass']}" in text
        assert "ninfer_kv_select_outside_mass_now" in text
        lines = [r.getMessage() for r in caplog.records if r.name == "ninfer.kvmem"]
        caplog.clear()
        outside = [float(line.rsplit("outside=", 1)[1]) for line in lines]
        assert outside and all(0.0 <= x <= 1.0 for x in outside)
        assert stats["kv_select_outside_mass"] == pytest.approx(sum(outside) / len(outside), rel=1e-2, abs=1e-3)
    assert 0.0 < shares[128][0] < 1.0 and 0.0 <= shares[128][1] <= 1.0
    assert shares[640] == (0.0, 0.0)
