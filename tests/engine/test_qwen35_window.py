"""KV windowing and retrieval on a Gated-DeltaNet hybrid: the window applies to the attention layers' KV only (the
recurrent layers carry the whole history in their state, docs/KV.md). With retrieval covering the context, the
windowed hybrid answers exactly as with the full cache."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.test_qwen35 import checkpoint, model, tokens  # noqa: F401  (module fixtures)

PAGE = 64


def _engine(model, *, num_pages=64, host_pages=0, kv_dtype=torch.float32, **kw) -> Engine:  # noqa: F811
    runner = ModelRunner(model, num_pages, kv_dtype, PAGE, host_pages=host_pages, state_slots=2)
    return Engine(runner, max_concurrency=2, prefill_chunk=128, max_context=4000,
                  **{"max_shared_prefixes": 0, **kw}).start()


def _generate(engine: Engine, prompt, n=24) -> tuple[list[int], dict]:
    try:
        out = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return out, engine.stats()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_dtype", [torch.float32, "k8v4"])
def test_window_with_retrieval_covering_the_context_equals_the_full_cache(model, kv_dtype):  # noqa: F811
    """A 700-token prompt, window 128 + retrieval of every older page over a host tier: the attention layers see
    the whole context through host pages and per-layer selection; the greedy answer is the full cache's."""
    prompt = tokens(60, 700)
    full, _ = _generate(_engine(model, kv_dtype=kv_dtype), prompt)
    tiered, s = _generate(_engine(model, kv_dtype=kv_dtype, num_pages=40, host_pages=64, kv_window=128,
                                  kv_retrieve=1024), prompt)
    assert tiered == full
    assert s["kv_retrieved_pages"] > 0 and s["kv_evictions"] > 0
    assert s["pages_free"] == s["pages_total"] and s["state_slots_free"] == s["state_slots_total"]


def test_a_lossy_window_on_a_hybrid_runs_reports_itself_and_returns_every_slot(model):  # noqa: F811
    """Window 128 without retrieval (--allow-lossy-window): the attention layers forget the middle of a 700-token
    prompt (the recurrent layers do not); the engine says it is lossy, and pages and state slots all come back."""
    lossy, s = _generate(_engine(model, num_pages=40, host_pages=64, kv_window=128, allow_lossy_window=True),
                         tokens(61, 700), 8)
    assert len(lossy) == 8 and s["kv_lossy"] is True and s["kv_window_tokens"] == 128
    assert s["pages_free"] == s["pages_total"] and s["state_slots_free"] == s["state_slots_total"]
