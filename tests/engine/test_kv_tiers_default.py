"""KV tiers on the embedded SmolLM2-135M-Instruct: the windowed path against the full cache."""
from __future__ import annotations

import logging
import re

import pytest

from engine.engine import Engine
from engine.runner import ModelRunner
from engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEAD = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
KEY = "The pass key is 71432. Remember it. 71432 is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def _engine(loaded, *, num_pages: int, host_pages: int = 0, max_context: int = 4096, **kw) -> Engine:
    runner = ModelRunner(loaded.engine.runner.model, num_pages, loaded.engine.runner.kv.kv_dtype, 64,
                         host_pages=host_pages)
    return Engine(runner, max_concurrency=1, prefill_chunk=512, max_context=max_context,
                  **{"max_shared_prefixes": 0, **kw}).start()


def _run(engine: Engine, ids: list[int], n: int) -> tuple[list[int], dict]:
    try:
        out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return out, engine.stats()
    finally:
        engine.shutdown()


def test_window_at_least_the_context_is_token_identical_to_the_full_cache(default_fp32_engine):
    """Ring on: the sequence takes the tiered path from its first token (pages written through to the host,
    window bookkeeping), with a window that covers the whole context."""
    tok = default_fp32_engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow and say why the "
                                    "sky is blue, in two sentences."}])
    full, _ = _run(_engine(default_fp32_engine, num_pages=16), ids, 24)
    tiered, s = _run(_engine(default_fp32_engine, num_pages=28, host_pages=16, kv_window=1024, kv_retrieve=64,
                             kv_ring="on"), ids, 24)
    assert tiered == full
    assert s["kv_writethrough_pages"] == (len(ids) + 22) // 64 and s["kv_host_pages_free"] == 16


def test_pass_key_far_outside_the_window_is_found_by_retrieval(default_fp32_engine, caplog):
    """~3,500 tokens of filler with a pass key near the start; window 512 + retrieve 512 tokens answers it exactly
    as the full cache does, and the page holding the key is among the retrieved ones."""
    tok = default_fp32_engine.tokenizer
    before = HEAD + FILLER * 12
    text = before + KEY + FILLER * 128 + QUESTION
    ids = tok.encode(text)
    assert 3300 <= len(ids) <= 3800, len(ids)
    key_at = len(tok.encode(before))
    key_pages = {key_at // 64, (key_at + len(tok.encode(KEY))) // 64}

    full, _ = _run(_engine(default_fp32_engine, num_pages=64), ids, 6)
    assert "71432" in tok.decode(full)

    with caplog.at_level(logging.DEBUG, logger="ninfer.kvmem"):
        windowed, s = _run(_engine(default_fp32_engine, num_pages=40, host_pages=64, kv_window=512, kv_retrieve=512),
                           ids, 6)
    assert windowed == full
    assert s["kv_retrieved_pages"] > 0 and s["kv_evictions"] > 0 and not s["kv_lossy"]
    assert s["pages_free"] == 40 and s["kv_host_pages_free"] == 64
    # the decode steps' selections (one line per layer and step): the key's page is chosen by most layers
    decode = [line for line in (r.getMessage() for r in caplog.records if r.name == "ninfer.kvmem")][-30 * 5:]
    chosen = [set(map(int, re.search(r"pages=\[([\d, ]*)\]", line).group(1).split(", "))) for line in decode]
    assert sum(bool(c & key_pages) for c in chosen) >= 0.5 * len(chosen)


def test_build_engine_sizes_both_tiers_from_the_settings(engine_for):

    loaded = engine_for(None, max_context=0, max_concurrency=2, kv_window=512, kv_retrieve=512,
                          host_kv_mib=64, kv_capacity="auto", weight_dtype="fp32")
    engine = loaded.engine
    page_bytes = engine.runner.kv.page_bytes
    s = engine.stats()
    footprint = 1 + (512 + 512) // 64 + 2 + 512 // 64
    assert s["pages_total"] == 2 * footprint  # auto: max_concurrency windowed footprints, not 2 x 8192 tokens
    assert s["kv_host_pages_total"] == 64 * 2**20 // page_bytes == s["kv_host_pages_free"]
    assert engine.kv_reach == s["kv_host_pages_total"] * 64
    assert (s["kv_window_tokens"], s["kv_retrieve_tokens"], s["kv_lossy"]) == (512, 512, False)


def test_ring_off_over_http_is_400_context_length_exceeded_saying_why(default_fp32_engine):
    """--kv-window 512 --kv-ring off behind the real server: a prompt longer than the window is a 400
    context_length_exceeded naming the setting, a short one is answered, and /metrics carries the KV tier gauges."""
    import dataclasses

    import httpx

    from engine.config.loading import load_settings
    from engine.server.state import ServerState
    from tests.api.conftest import RunningServer

    engine = _engine(default_fp32_engine, num_pages=16, kv_window=512, kv_ring="off")
    settings, _ = load_settings(["--kv-window", "512", "--kv-ring", "off"], {})
    state = ServerState(settings, ["smol"])
    state.loaded = dataclasses.replace(default_fp32_engine, engine=engine)
    try:
        with RunningServer(state) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 4, "messages": [
                {"role": "user", "content": "word " * 700}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "--kv-ring off" in r.json()["error"]["message"]
            r = http.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 4, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            metrics = http.get("/metrics").text
            assert "ninfer_kv_window_tokens 0.0" in metrics  # ring off: no windowed path, the window is a cap
            assert "ninfer_kv_host_pages_free 0.0" in metrics
    finally:
        engine.shutdown()
