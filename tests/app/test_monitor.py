"""The monitor's numbers from a stats dict, before and after the engine reports speculative decoding and a KV host
tier: acceptance only while drafting runs, host pages and retrieved pages/s only when reported, prefix reuse."""
from __future__ import annotations

import pytest

from app.client import read_metrics
from app.monitor.model import Rates, cards, local_values

BASE = {"decode_tokens": 100, "decode_seconds": 2.0, "decode_tokens_per_second": 50.0, "pages_used": 3,
        "pages_free": 29, "running": 1, "waiting": 0, "prefix_hit_ratio": 0.25,
        "prefix_cached_pages": 4, "ttft_seconds": {"p50": 0.12}, "http_requests_total": 67,
        # the app's own once-a-second polls (/health, the settings) are not requests anyone sent the API
        "http_requests": {"/v1/chat/completions": {"200": 5, "400": 1}, "/v1/models": {"200": 1},
                          "/health": {"200": 40}, "/ninfer/v1/settings": {"200": 20}}}
SPEC = {"spec_drafted": 200, "spec_accepted": 150, "spec_acceptance": 0.75, "spec_mean_accepted": 2.5}
TIER = {"kv_host_pages_used": 5, "kv_host_pages_free": 59, "kv_host_pages_total": 64}


@pytest.mark.parametrize("tier", [{}, {"kv_host_pages_used": 0, "kv_host_pages_free": 0, "kv_host_pages_total": 0,
                                          "kv_retrieved_pages": 0}])
def test_without_spec_or_host_tier_keys(tier):
    """Before the keys exist, and with the zeros an engine without a host tier reports."""
    v = local_values({**BASE, **tier}, Rates(), now=0.0)
    assert v["host_pages_used"] is None and v["retrieved_pps"] is None
    c = cards(v)
    assert c["spec"].value == "not running" and c["spec"].detail == "speculative decoding is off"
    assert c["kv"].value == "3 / 32" and c["kv"].detail == "pages used / total"
    assert "host" not in c["kv"].detail and "retrieved" not in c["kv"].detail
    assert c["prefix"].value == "25%" and "4 pages cached" in c["prefix"].detail
    assert c["requests"].value == "1 running" and "7 API requests" in c["requests"].detail
    assert "average 50.0 tok/s" in c["decode"].detail and "TTFT p50 0.12 s" in c["decode"].detail


def test_acceptance_is_shown_while_speculative_decoding_runs():
    c = cards(local_values({**BASE, **SPEC}, Rates(), now=0.0))
    assert c["spec"].value == "75% accepted"
    assert c["spec"].detail == "200 tokens drafted · 2.50 accepted per step"
    idle = cards(local_values({**BASE, **SPEC, "spec_drafted": 0, "spec_accepted": 0, "spec_acceptance": 0.0},
                              Rates(), now=0.0))
    assert idle["spec"].value == "not running" and idle["spec"].detail == "no draft tokens yet"
    off = cards(local_values({**BASE, "spec_drafted": 0, "spec_method": "none"}, Rates(), now=0.0))
    assert off["spec"].value == "not running" and off["spec"].detail == "speculative decoding is off"
    waiting = cards(local_values({**BASE, "spec_drafted": 0, "spec_method": "ngram"}, Rates(), now=0.0))
    assert waiting["spec"].value == "not running" and waiting["spec"].detail == "--spec ngram: no draft tokens yet"
    # a server that reports counts only: acceptance from accepted / drafted
    counted = cards({"spec_drafted": 40, "spec_accepted": 10})
    assert counted["spec"].value == "25% accepted"


def test_host_pages_and_retrieved_pages_per_second():
    rates = Rates()
    local_values({**BASE, **TIER, "kv_retrieved_pages": 10}, rates, now=100.0)
    v = local_values({**BASE, **TIER, "kv_retrieved_pages": 40, "decode_tokens": 160, "decode_seconds": 3.0},
                     rates, now=102.0)
    assert v["retrieved_pps"] == pytest.approx(15.0) and v["decode_tps"] == pytest.approx(60.0)
    assert v["host_pages_used"] == 5 and v["host_pages_free"] == 59
    c = cards(v)
    assert c["kv"].detail == "GPU pages used / total · host 5 / 64 pages · retrieved 15.0 pages/s"
    # retrieval straining: the share of attention mass on pages it left on the host, from the engine and /metrics
    strained = cards(local_values({**BASE, **TIER, "kv_retrieved_pages": 40, "kv_select_outside_mass_now": 0.23},
                                  rates, now=103.0))
    assert strained["kv"].detail.endswith("retrieval leaves 23% of attention out")
    remote = read_metrics("ninfer_engine_attached 1\nninfer_kv_pages_used 2\nninfer_kv_pages_free 6\n"
                          "ninfer_kv_select_outside_mass_now 0.07\n")
    assert "retrieval leaves 7% of attention out" in cards(remote.values)["kv"].detail


def test_remote_metrics_prefix_and_acceptance():
    ninfer = read_metrics("ninfer_engine_attached 1\nninfer_kv_pages_used 2\nninfer_kv_pages_free 6\n"
                          "ninfer_prefix_hit_ratio 0.5\n")
    assert ninfer.values["prefix_hit_ratio"] == 0.5 and cards(ninfer.values)["spec"].value == "not running"
    vllm = read_metrics("vllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n"
                        "vllm:prefix_cache_queries_total 400\nvllm:prefix_cache_hits_total 100\n"
                        "vllm:spec_decode_num_draft_tokens_total 80\nvllm:spec_decode_num_accepted_tokens_total 60\n")
    c = cards(vllm.values)
    assert vllm.values["prefix_hit_ratio"] == 0.25 and c["prefix"].value == "25%"
    assert c["spec"].value == "75% accepted" and c["spec"].detail.startswith("80 tokens drafted")


class _Service:
    def __init__(self, stats):
        self._stats = stats

    def stats(self):
        return dict(self._stats)


class _Controller:
    remote = False
    client = None

    def __init__(self, stats):
        self.service = _Service(stats)


def test_monitor_panel_shows_a_stats_dict(qapp):
    from app.monitor.panel import MonitorPanel

    controller = _Controller({**BASE, "status": "ready", "url": "http://127.0.0.1:1/v1", "device": "cpu",
                              "kv_host_pages_used": 0, "kv_host_pages_free": 0})
    panel = MonitorPanel(controller)
    panel.timer.stop()
    try:
        panel.tick()
        assert panel.stat_spec.value.text() == "not running" and panel.stat_prefix.value.text() == "25%"
        assert panel.curve_host is None and panel.stat_kv.value.text() == "3 / 32"
        controller.service = _Service({**BASE, **SPEC, **TIER, "kv_retrieved_pages": 0, "status": "ready"})
        panel.tick()
        assert panel.stat_spec.value.text() == "75% accepted"
        assert "host 5 / 64 pages" in panel.stat_kv.detail.text()
        assert panel.curve_host is not None and list(panel.series["host_pages_used"])[-1] == 5
        assert panel.updates == 2 and panel.last["spec_acceptance"] == 0.75
        bottom, top = panel.plot_kv.getViewBox().viewRange()[1]
        assert top == pytest.approx(32 * 1.15) and bottom < 0  # an idle "used" line shows above the axis
        panel.restyle()
        from app import theme
        title = panel.plot_kv.plotItem.titleLabel.text
        assert panel.plot_kv.plotItem.legend is None  # the curves are named in the title, not covered by a legend
        assert "used" in title and "free" in title and "host used" in title and theme.colors()["series2"] in title
    finally:
        panel.close()


def test_a_remote_ninfer_metrics_page_feeds_every_card():
    """The names NInfer's own /metrics exposes (engine.metrics, fed by a stand-in engine) reach the cards."""
    from engine.metrics import Metrics

    class _Engine:
        def stats(self):
            return {**BASE, **SPEC, **TIER, "pages_total": 32, "kv_retrieved_pages": 12, "spec_steps": 80}

    metrics = Metrics()
    metrics.attach(_Engine())
    text = metrics.render()[0].decode()
    reading = read_metrics(text, server="test-remote")
    assert reading.available and reading.note == "NInfer"
    c = cards(reading.values)
    assert c["kv"].value == "3 / 32" and "host 5 / 64 pages" in c["kv"].detail
    assert c["prefix"].value == "25%"
    assert c["spec"].value == "75% accepted" and c["spec"].detail == "200 tokens drafted · 2.50 accepted per step"
