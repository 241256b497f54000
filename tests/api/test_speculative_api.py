"""Speculative decoding through the API: usage reports the drafted tokens accepted and rejected per request, and
/metrics the engine's counters."""
from __future__ import annotations

import httpx
import pytest

from engine.build import build_engine
from engine.config.loading import load_settings
from engine.server.state import ServerState
from tests.api.conftest import RunningServer, wait_idle
from tests.engine.spec_models import tiny_folder


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("spec-api"), "target", 1)
    loaded = build_engine(str(folder), max_context=512, max_concurrency=2, spec="ngram")
    loaded.engine.start()
    settings, _ = load_settings([], {})
    state = ServerState(settings, ["tiny"])
    state.loaded = loaded
    try:
        with RunningServer(state) as running:
            yield running, loaded.engine
    finally:
        loaded.engine.shutdown()


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_usage_and_metrics_report_speculation(spec_server):
    running, engine = spec_server
    with httpx.Client(base_url=running.base_url, timeout=60) as http:
        before = engine.stats()
        body = {"model": "tiny", "prompt": " ".join(f"w{i}" for i in [5, 6, 7, 8] * 6), "max_tokens": 60,
                "temperature": 0, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        after = wait_idle(engine)
        details = usage["completion_tokens_details"]
        drafted = after["spec_drafted"] - before["spec_drafted"]
        assert drafted > 0 and usage["completion_tokens"] == 60
        assert details["accepted_prediction_tokens"] == after["spec_accepted"] - before["spec_accepted"]
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == drafted
        metrics = http.get("/metrics").text
        assert _metric(metrics, "ninfer_spec_drafted_tokens_total") == after["spec_drafted"]
        assert _metric(metrics, "ninfer_spec_accepted_tokens_total") == after["spec_accepted"]
        assert _metric(metrics, "ninfer_spec_acceptance_ratio") == pytest.approx(after["spec_acceptance"])
        # streamed, with usage in the last chunk
        with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as s:
            chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert "completion_tokens_details" in chunks[-1]
