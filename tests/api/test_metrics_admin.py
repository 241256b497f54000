"""/metrics (Prometheus) and /ninfer/v1/settings (mode and sampling defaults switched live), over real HTTP."""
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config.loading import settings_from_mapping
from engine.metrics import Metrics
from engine.server.state import ServerState
from tests.api.conftest import RunningServer, wait_idle

MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Say hello."}]
SETTINGS = "/ninfer/v1/settings"


def scrape(client) -> dict:
    """/metrics as {(sample name, frozenset of labels): value}."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def chat(client, **fields):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **fields})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def restore_settings(server):
    """The session's server is shared: put its settings back whatever a test switched."""
    original = server.state.settings
    yield server.state
    server.state.apply_settings(original)


@pytest.fixture
def spy(default_engine, monkeypatch):
    """Records the SamplingParams of every request the engine gets (monkeypatch restores submit afterwards)."""
    engine = default_engine.engine
    seen = []
    real = engine.submit

    def submit(prompt, params, *args, **kwargs):
        seen.append(params)
        return real(prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", submit)
    return seen


# ---------------------------------------------------------------- /metrics

def test_metrics_after_a_chat_request(server, http, default_engine):
    before = scrape(http)
    ok = ("ninfer_http_requests_total", dict(route="/v1/chat/completions", method="POST", status="200"))
    counted = value(before, ok[0], **ok[1]) or 0
    ttft = value(before, "ninfer_time_to_first_token_seconds_count") or 0

    body = chat(http, max_tokens=8, ignore_eos=True, temperature=0)
    assert body["usage"]["completion_tokens"] == 8
    wait_idle(default_engine.engine)
    samples = scrape(http)

    assert value(samples, *ok[:1], **ok[1]) == counted + 1
    assert value(samples, "ninfer_time_to_first_token_seconds_count") >= ttft + 1 >= 1
    assert value(samples, "ninfer_time_to_first_token_seconds_sum") > 0
    assert value(samples, "ninfer_engine_attached") == 1
    used, free = value(samples, "ninfer_kv_pages_used"), value(samples, "ninfer_kv_pages_free")
    total = value(samples, "ninfer_kv_pages_capacity")
    assert total > 0 and used + free == total
    assert value(samples, "ninfer_kv_page_size_tokens") > 0
    assert value(samples, "ninfer_decode_tokens_per_second", window="lifetime") > 0
    assert value(samples, "ninfer_prefill_tokens_per_second", window="lifetime") > 0
    assert value(samples, "ninfer_decode_tokens_per_second", window="recent") > 0  # this request's decode steps
    assert value(samples, "ninfer_requests_running") == 0 and value(samples, "ninfer_requests_waiting") == 0
    assert value(samples, "ninfer_engine_requests_finished_total") >= 1
    for name in ("ninfer_preemptions_total", "ninfer_engine_requests_aborted_total",
                 "ninfer_engine_requests_failed_total", "ninfer_decode_tokens_total", "ninfer_prefill_tokens_total"):
        assert value(samples, name) is not None, name

    snap = server.state.metrics.snapshot()
    assert snap["engine_attached"] is True
    assert (snap["pages_used"], snap["pages_free"], snap["pages_total"]) == (used, free, total)
    assert snap["http_requests"]["/v1/chat/completions"][200] == counted + 1
    assert snap["ttft_seconds"]["count"] == value(samples, "ninfer_time_to_first_token_seconds_count")
    assert snap["ttft_seconds"]["p50"] > 0
    assert snap["decode_tokens_per_second"] == pytest.approx(
        value(samples, "ninfer_decode_tokens_per_second", window="lifetime"))
    assert snap["running"] == 0 and snap["waiting"] == 0


def test_prefix_reuse_metrics_are_the_engines(http, default_engine):
    """The same chat sent twice: the second copies the first's partial last page (copy on write); /metrics carries
    the prefix counters and gauges with the engine's own numbers."""
    messages = [{"role": "user", "content": "Name three rivers of Europe, one per line, nothing else please."}]
    for _ in range(2):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
    wait_idle(default_engine.engine)
    samples, stats = scrape(http), default_engine.engine.stats()
    assert stats["prefix_partial_copies"] >= 1 and stats["prefix_partial_tokens"] >= 1
    for name, key in (("ninfer_prefix_partial_copies_total", "prefix_partial_copies"),
                      ("ninfer_prefix_partial_tokens_total", "prefix_partial_tokens"),
                      ("ninfer_prefix_windowed_hit_tokens_total", "prefix_windowed_hit_tokens"),
                      ("ninfer_prefix_host_hit_tokens_total", "prefix_host_hit_tokens"),
                      ("ninfer_prefix_hit_tokens_total", "prefix_hit_tokens"),
                      ("ninfer_prefix_tail_pages", "prefix_tail_pages"),
                      ("ninfer_prefix_host_pages", "prefix_host_pages")):
        assert value(samples, name) == stats[key], name


def test_recent_rates_cover_only_the_work_since_the_previous_scrape(http, default_engine):
    chat(http, max_tokens=4, ignore_eos=True, temperature=0)
    wait_idle(default_engine.engine)
    scrape(http)
    idle = scrape(http)  # nothing ran in between
    assert value(idle, "ninfer_decode_tokens_per_second", window="recent") == 0
    assert value(idle, "ninfer_decode_tokens_per_second", window="lifetime") > 0
    chat(http, max_tokens=4, ignore_eos=True, temperature=0)
    wait_idle(default_engine.engine)
    assert value(scrape(http), "ninfer_decode_tokens_per_second", window="recent") > 0


def test_errors_and_unknown_paths_are_counted_with_their_status(server, http):
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO})
    assert r.status_code == 404
    assert http.get("/no/such/route").status_code == 404
    samples = scrape(http)
    assert value(samples, "ninfer_http_requests_total", route="/v1/chat/completions", method="POST",
                 status="404") >= 1
    assert value(samples, "ninfer_http_requests_total", route="other", method="GET", status="404") >= 1
    assert not any(dict(labels).get("route") == "/no/such/route" for _, labels in samples)


@contextmanager
def serving(engine=None, **values):
    state = ServerState(settings_from_mapping(values, "test"), [MODEL])
    state.loaded = engine
    with RunningServer(state) as running, httpx.Client(base_url=running.base_url, timeout=60) as client:
        yield running, client


def test_security_refusals_are_counted_and_metrics_need_the_key():
    key = "sk-metrics-test"
    with serving(api_key=key) as (running, client):  # no engine: the model is "still loading"
        assert client.get("/v1/models").status_code == 401
        assert client.get("/metrics").status_code == 401
        samples = scrape(httpx.Client(base_url=running.base_url, headers={"Authorization": f"Bearer {key}"}))
        assert value(samples, "ninfer_http_requests_total", route="/v1/models", method="GET", status="401") == 1
        assert value(samples, "ninfer_engine_attached") == 0
        snap = running.state.metrics.snapshot()
        assert snap["engine_attached"] is False and snap["pages_total"] is None
        assert snap["http_requests"]["/metrics"][401] == 1


def test_each_server_has_its_own_registry_and_ttft_callback(default_engine):
    engine = default_engine.engine
    a, b = Metrics(), Metrics()
    a.attach(engine)
    b.attach(engine)
    a.attach(engine)  # the same engine again: no second callback
    try:
        assert engine.on_first_token.count(a.observe_ttft) == 1
        a.observe_ttft(0.5)
        a.count_request("/health", "GET", 200)
        assert b"ninfer_http_requests_total" in a.render()[0]
        assert a.snapshot()["ttft_seconds"]["count"] == 1 and b.snapshot()["ttft_seconds"]["count"] == 0
        assert b.snapshot()["http_requests"] == {}
    finally:
        a.detach()
        b.detach()
    assert a.observe_ttft not in engine.on_first_token and b.observe_ttft not in engine.on_first_token


# ---------------------------------------------------------------- /ninfer/v1/settings

def test_get_settings(server, http, default_engine):
    r = http.get(SETTINGS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["mode"] == "chat" and body["greedy"] is False
    assert body["sampling"]["temperature"] == 0.7 and body["sampling"]["top_p"] == 0.9
    assert body["model_ids"] == server.state.model_ids
    assert body["context_window"] == default_engine.context_window
    assert "api_key" not in body["settings"] and "api_key" not in body["sources"]
    assert body["settings"]["port"] == 8080 and body["sources"]["mode"] == "default"
    assert "mode" in body["live_keys"]


def test_switching_to_agent_mode_applies_to_the_next_request(http, restore_settings, spy):
    r = http.put(SETTINGS, json={"mode": "agent"})
    assert r.status_code == 200, r.text
    assert r.json()["mode"] == "agent"
    body = http.get(SETTINGS).json()
    assert body["mode"] == "agent" and body["sources"]["mode"].startswith("api:")
    assert body["sampling"]["temperature"] == 0.2 and body["sampling"]["presence_penalty"] == 0.05

    chat(http, max_tokens=2)
    params = spy[-1]
    assert (params.temperature, params.top_p, params.presence_penalty) == (0.2, 0.8, 0.05)
    chat(http, max_tokens=2, temperature=1.1)  # the request's own values still win
    assert spy[-1].temperature == 1.1

    r = http.put(SETTINGS, json={"mode": "chat"})
    assert r.status_code == 200 and r.json()["sampling"]["temperature"] == 0.7
    chat(http, max_tokens=2)
    assert (spy[-1].temperature, spy[-1].presence_penalty) == (0.7, 0.0)


def test_explicit_sampling_defaults_win_over_the_mode(http, restore_settings, spy):
    body = http.put(SETTINGS, json={"temperature": 0.5, "top_k": 5}).json()
    assert body["sampling"]["temperature"] == 0.5 and body["sampling"]["top_k"] == 5
    body = http.put(SETTINGS, json={"mode": "agent"}).json()
    assert body["sampling"]["temperature"] == 0.5 and body["sampling"]["presence_penalty"] == 0.05
    body = http.put(SETTINGS, json={"temperature": None}).json()  # unset: the mode's value again
    assert body["sampling"]["temperature"] == 0.2
    body = http.put(SETTINGS, json={"greedy": True}).json()
    assert body["greedy"] is True and body["sampling"]["temperature"] == 0.0
    chat(http, max_tokens=2)
    assert spy[-1].temperature == 0.0 and spy[-1].top_k == 5
    body = http.put(SETTINGS, json={"mode": "chat", "greedy": False, "top_k": None}).json()
    assert body["mode"] == "chat" and body["sampling"]["temperature"] == 0.7 and body["sampling"]["top_k"] == 20


@pytest.mark.parametrize("change, param, words", [
    ({"mode": "turbo"}, "mode", "must be one of chat, agent"),
    ({"temperature": 5}, "temperature", "0.0 to 2.0"),
    ({"top_p": 0}, "top_p", "above"),
    ({"greedy": "maybe"}, "greedy", "true or false"),
    ({"port": 1}, "port", "restart with --port"),
    ({"api_key": "x"}, "api_key", "restart with --api-key"),
    ({"colour": "blue"}, "colour", "not a setting"),
])
def test_bad_settings_are_refused_and_change_nothing(http, restore_settings, change, param, words):
    before = http.get(SETTINGS).json()
    r = http.put(SETTINGS, json={"mode": "agent", **change} if param != "mode" else change)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"]
    assert http.get(SETTINGS).json() == before


@pytest.mark.parametrize("content", [b"[1, 2]", b"{}", b"{not json"])
def test_settings_body_must_be_a_json_object_of_settings(http, restore_settings, content):
    r = http.put(SETTINGS, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
