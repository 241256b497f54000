"""build_engine sizes the KV pools with the memory ledger: what `ninfer-doctor --ledger` and the app show is what the
engine allocates, and a context the KV memory cannot reach is refused (or, left to the model, shortened, saying so)."""
import logging
from types import SimpleNamespace

import httpx
import psutil
import pytest

from engine.build import build_engine
from engine.errors import NInferError
from engine.ledger import MIB

FOOTPRINT = 1 + (512 + 512) // 64 + 2 + 512 // 64  # sink + window and one chunk + edges + retrieved


def _available(monkeypatch, mib: int) -> None:
    real = psutil.virtual_memory()
    fake = SimpleNamespace(**{k: getattr(real, k) for k in real._fields})
    fake.available = mib * MIB
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)


def test_windowed_pools_are_the_ledgers(engine_for):
    loaded = engine_for(None, max_context=0, max_concurrency=2, kv_window=512, kv_retrieve=512, host_kv_mib=64,
                          weight_dtype="fp32")
    engine, ledger = loaded.engine, loaded.ledger
    assert engine.pool.num_pages == ledger.gpu_pages == 2 * FOOTPRINT  # two windowed conversations, nothing more
    assert engine.runner.host.num_pages == ledger.host_pages == 64 * MIB // engine.runner.kv.page_bytes
    assert ledger.page_bytes == engine.runner.kv.page_bytes
    assert engine.kv_reach == ledger.reach_tokens == ledger.host_pages * 64
    # the model's 8192 tokens are beyond the 64 MiB host tier's reach: left to the model, the context is the reach
    assert loaded.context_window == engine.context_tokens == ledger.reach_tokens < 8192
    assert "host KV tier" in engine.context_limit


def test_explicit_context_beyond_reach_is_refused_naming_the_host_tier(engine_for):
    with pytest.raises(NInferError) as e:
        engine_for(None, max_context=8192, max_concurrency=2, kv_window=512, kv_retrieve=512, host_kv_mib=64,
                     weight_dtype="fp32")
    assert "--max-context 8,192 is beyond reach" in e.value.problem and "host KV pages" in e.value.problem
    assert "--host-kv-mib" in e.value.remedy


def test_auto_capacity_follows_the_memory_free_now(engine_for, monkeypatch, caplog):
    """On the CPU the pool may take a quarter of the RAM available after loading: with 1400 MiB available, 350 MiB
    of fp32 KV at 2.81 MiB a page is 124 pages, less than one 8192-token sequence; the context becomes 7936 tokens
    and the log says why."""
    _available(monkeypatch, 1400)
    with caplog.at_level(logging.WARNING, logger="ninfer.build"):
        loaded = engine_for(None, max_context=0, max_concurrency=4, weight_dtype="fp32")
    page_mib = loaded.engine.runner.kv.page_bytes / MIB
    assert loaded.engine.pool.num_pages == loaded.ledger.gpu_pages == int(350 // page_mib) == 124
    assert loaded.context_window == loaded.engine.pool.num_pages * 64 == 7936
    assert any("less than the model's 8192" in r.getMessage() for r in caplog.records)
    # an explicit context that one sequence cannot hold is refused before the pool is allocated
    with pytest.raises(NInferError) as e:
        engine_for(None, max_context=8192, max_concurrency=4, weight_dtype="fp32")
    assert "does not fit" in e.value.problem and "Lower --max-context to" in e.value.remedy


def test_server_refuses_a_prompt_beyond_the_kv_reach_and_reports_it(engine_for, monkeypatch):
    """/v1/models reports the context the engine can hold (here the host tier's reach, shorter than the model's
    context); a prompt longer than it is a 400 context_length_exceeded from the server naming what limits it, before
    anything is queued."""
    from engine.config.loading import load_settings
    from engine.server.state import ServerState
    from tests.api.conftest import RunningServer

    loaded = engine_for(None, max_context=0, max_concurrency=1, kv_window=512, kv_retrieve=512, host_kv_mib=48,
                          weight_dtype="fp32")
    reach = loaded.context_window
    assert reach == loaded.engine.kv_reach == loaded.engine.max_context == 17 * 64 < 8192  # 17 host pages
    loaded.engine.start()
    try:
        settings, _ = load_settings([], {})
        state = ServerState(settings, ["smol"])
        state.loaded = loaded
        with RunningServer(state) as server:
            models = httpx.get(server.base_url + "/v1/models").json()["data"]
            assert models[0]["max_model_len"] == reach
            words = " ".join(["lorem"] * (reach + 50))
            r = httpx.post(server.base_url + "/v1/completions",
                           json={"model": "smol", "prompt": words, "max_tokens": 4}, timeout=60)
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and f"holds {reach} tokens" in err["message"]
            assert "host KV tier" in err["message"]
            assert loaded.engine.counters["requests"] == 0
    finally:
        loaded.engine.shutdown()


def test_loading_runs_on_a_thread_that_ends():
    """build_engine loads on a thread of its own (engine.build.in_own_thread): results and errors come back to the
    caller unchanged, and the thread is gone afterwards (its OpenMP pool with it)."""
    import threading

    from engine.build import in_own_thread

    seen = []
    assert in_own_thread(lambda a, b=0: seen.append(threading.current_thread()) or a + b)(2, b=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(NInferError) as e:
        build_engine(None, max_context=10**9)
    assert "--max-context 1000000000 is beyond this model's trained context" in e.value.problem
