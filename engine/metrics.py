"""Server metrics: Prometheus exposition for ``GET /metrics`` and a plain-dict ``snapshot()`` for the desktop monitor.

One ``Metrics`` per server, each with its own ``CollectorRegistry`` (never prometheus_client's global one), so several
servers can live in one process. What it measures:

- HTTP requests by route template, method and status (``count_request``, fed by ``RequestCounter``, a pure-ASGI
  middleware that sits outside the security middleware, so its refusals are counted too);
- time to first token (a histogram fed by a callback in ``engine.on_first_token``; ``attach(engine)`` registers it);
- everything else is read from ``Engine.stats()`` at scrape/snapshot time by a custom collector: queue depth,
  running sequences, KV pages, prefix reuse (hits, hit ratio, cached pages and chains, evictions), preemptions,
  engine request outcomes, token and time counters, and prefill/decode
  speeds, both as lifetime averages (tokens / engine seconds spent on them) and over the recent window (the delta of
  the same counters since the previous scrape, or since the previous snapshot: each consumer has its own window).

No Qt and no torch here: the desktop app reads ``snapshot()``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.routing import Match

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RECENT_TTFT = 256  # first-token latencies kept for the snapshot's percentiles
OTHER_ROUTE = "other"  # the route label of paths that match no route (keeps the label set bounded)

# Engine.stats() keys, with their value when an engine (or a test double) does not report them.
_STAT_DEFAULTS = dict(requests=0, finished=0, aborted=0, errors=0, prefill_tokens=0, decode_tokens=0,
                      prefill_seconds=0.0, decode_seconds=0.0, steps=0, running=0, waiting=0, preemptions=0,
                      pages_total=0, pages_free=0, page_size=0, pages_cached=0, prefix_hits=0, prefix_hit_tokens=0,
                      prefix_prompt_tokens=0, prefix_hit_ratio=0.0, prefix_cached_pages=0, prefix_chains=0,
                      prefix_evicted_pages=0, prefix_partial_copies=0, prefix_partial_tokens=0, prefix_tail_pages=0,
                      prefix_windowed_hit_tokens=0, prefix_host_pages=0, prefix_host_hit_tokens=0,
                      kv_host_pages_total=0, kv_host_pages_used=0, kv_host_pages_free=0,
                      kv_window_tokens=0, kv_retrieve_tokens=0, kv_windowed_sequences=0, kv_evictions=0,
                      kv_writethrough_pages=0, kv_retrieved_pages=0, kv_retrieved_bytes=0, kv_retrieve_seconds=0.0,
                      kv_select_outside_mass=0.0, kv_select_outside_mass_now=0.0,
                      spec_drafted=0, spec_accepted=0, spec_steps=0, spec_acceptance=0.0, spec_mean_accepted=0.0)
_RATE_KEYS = ("prefill_tokens", "prefill_seconds", "decode_tokens", "decode_seconds")


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 and tokens > 0 else 0.0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Metrics:
    """The metrics of one server. ``attach(engine)`` once the engine is loaded; before that only HTTP counts exist."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("ninfer_http_requests", "HTTP requests answered, by route template, method and "
                                 "status.", ["route", "method", "status"], registry=self.registry)
        self._ttft = Histogram("ninfer_time_to_first_token_seconds", "Seconds from a request's arrival at the "
                               "engine to its first generated token.", buckets=TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(self))
        self._lock = threading.Lock()
        self._engine = None
        self._callback = None
        self._by_route: dict[str, dict[int, int]] = {}
        self._ttft_count, self._ttft_sum, self._ttft_recent = 0, 0.0, deque(maxlen=RECENT_TTFT)
        self._windows: dict[str, tuple[float, dict]] = {}  # consumer -> (time, rate counters) of its last read

    # ---- feeding -------------------------------------------------------------------------------------------
    def attach(self, engine) -> None:
        """Measures ``engine`` from now on (detaching from the previous one); a no-op for the same engine."""
        with self._lock:
            if engine is self._engine:
                return
            self._detach_locked()
            self._engine = engine
            self._windows.clear()
            callbacks = getattr(engine, "on_first_token", None)
            if isinstance(callbacks, list):
                self._callback = self.observe_ttft
                callbacks.append(self._callback)

    def detach(self) -> None:
        with self._lock:
            self._detach_locked()

    def _detach_locked(self) -> None:
        if self._engine is not None and self._callback is not None:
            try:
                self._engine.on_first_token.remove(self._callback)
            except (AttributeError, ValueError):
                pass
        self._engine, self._callback = None, None

    @property
    def engine(self):
        return self._engine

    def observe_ttft(self, seconds: float) -> None:
        """Called on the engine thread for every request's first token: cheap, and thread-safe."""
        self._ttft.observe(seconds)
        with self._lock:
            self._ttft_count += 1
            self._ttft_sum += seconds
            self._ttft_recent.append(seconds)

    def count_request(self, route: str, method: str, status: int) -> None:
        self._requests.labels(route, method, str(status)).inc()
        with self._lock:
            statuses = self._by_route.setdefault(route, {})
            statuses[status] = statuses.get(status, 0) + 1

    # ---- reading -------------------------------------------------------------------------------------------
    def engine_stats(self, window: str | None = None) -> dict[str, Any] | None:
        """Engine.stats() with every key present, plus pages_used and the token rates; None before ``attach``.

        ``window`` names the consumer whose recent window this read ends (and the next one starts): "scrape" for
        /metrics, "snapshot" for snapshot(); the recent rates cover the engine work done since its previous read.
        """
        engine = self._engine
        if engine is None:
            return None
        try:
            raw = engine.stats()
        except Exception:  # a half-built or test engine: report what we can
            raw = {}
        stats = {k: raw.get(k, v) for k, v in _STAT_DEFAULTS.items()}
        stats["pages_used"] = stats["pages_total"] - stats["pages_free"]
        stats["prefill_tokens_per_second"] = _rate(stats["prefill_tokens"], stats["prefill_seconds"])
        stats["decode_tokens_per_second"] = _rate(stats["decode_tokens"], stats["decode_seconds"])
        stats["kv_retrieve_mib_per_second"] = _rate(stats["kv_retrieved_bytes"] / 2**20, stats["kv_retrieve_seconds"])
        stats["kv_retrieved_pages_per_step"] = _rate(stats["kv_retrieved_pages"], stats["steps"])
        now = time.monotonic()
        current = {k: stats[k] for k in _RATE_KEYS}
        with self._lock:
            previous = self._windows.get(window) if window else None
            if window:
                self._windows[window] = (now, current)
        if previous is None:  # the first read of this consumer: the recent window is the whole lifetime
            since, base = None, dict.fromkeys(_RATE_KEYS, 0)
        else:
            since, base = previous
        stats["prefill_tokens_per_second_recent"] = _rate(current["prefill_tokens"] - base["prefill_tokens"],
                                                          current["prefill_seconds"] - base["prefill_seconds"])
        stats["decode_tokens_per_second_recent"] = _rate(current["decode_tokens"] - base["decode_tokens"],
                                                         current["decode_seconds"] - base["decode_seconds"])
        stats["recent_window_seconds"] = None if since is None else now - since
        return stats

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type (for the /metrics route)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def snapshot(self) -> dict[str, Any]:
        """The same numbers as /metrics, as plain Python, for the app's monitor (its own recent-rate window)."""
        stats = self.engine_stats("snapshot")
        with self._lock:
            by_route = {route: dict(statuses) for route, statuses in self._by_route.items()}
            count, total, recent = self._ttft_count, self._ttft_sum, list(self._ttft_recent)
        snap: dict[str, Any] = {
            "time": time.time(),
            "engine_attached": stats is not None,
            "http_requests": by_route,  # route -> {status: count}
            "http_requests_total": sum(n for statuses in by_route.values() for n in statuses.values()),
            "ttft_seconds": {"count": count, "sum": total, "mean": total / count if count else None,
                             "last": recent[-1] if recent else None, "p50": _percentile(recent, 0.5),
                             "p95": _percentile(recent, 0.95)},
        }
        snap.update(stats if stats is not None else
                    {k: None for k in (*_STAT_DEFAULTS, "pages_used", "prefill_tokens_per_second",
                                       "decode_tokens_per_second", "prefill_tokens_per_second_recent",
                                       "decode_tokens_per_second_recent", "recent_window_seconds",
                                       "kv_retrieve_mib_per_second", "kv_retrieved_pages_per_step")})
        return snap


class _EngineCollector:
    """Reads Engine.stats() at scrape time (nothing is copied on the engine thread)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []  # names are only known at collect time; keeps the registry from collecting at registration

    def collect(self):
        stats = self.metrics.engine_stats("scrape")
        yield GaugeMetricFamily("ninfer_engine_attached", "1 once the model is loaded and measured, else 0.",
                                value=0 if stats is None else 1)
        if stats is None:
            return
        gauges = [
            ("ninfer_requests_waiting", "Requests queued for a free slot (queue depth).", "waiting"),
            ("ninfer_requests_running", "Sequences being generated now.", "running"),
            ("ninfer_kv_pages_used", "KV-cache pages held by sequences.", "pages_used"),
            ("ninfer_kv_pages_free", "KV-cache pages free, counting idle cached prefix pages (evicted on demand).",
             "pages_free"),
            ("ninfer_kv_pages_cached", "Idle KV-cache pages keeping a reusable prompt prefix (part of the free ones).",
             "pages_cached"),
            ("ninfer_prefix_cached_pages", "KV-cache pages registered for prefix reuse, held or idle.",
             "prefix_cached_pages"),
            ("ninfer_prefix_cached_chains", "Distinct cached prompt prefixes (bounded by --max-shared-prefixes).",
             "prefix_chains"),
            ("ninfer_prefix_hit_ratio", "Prompt tokens served from cached prefixes / prompt tokens admitted.",
             "prefix_hit_ratio"),
            ("ninfer_prefix_tail_pages", "Partial last pages kept for reuse by copy (part of the cached pages).",
             "prefix_tail_pages"),
            ("ninfer_prefix_host_pages", "Host-memory KV pages keeping a reusable prefix (the host prefix store).",
             "prefix_host_pages"),
            ("ninfer_kv_pages_capacity", "KV-cache pages in all (used + free).", "pages_total"),
            ("ninfer_kv_page_size_tokens", "Tokens per KV-cache page.", "page_size"),
            ("ninfer_kv_host_pages_used", "Host-memory KV pages held by windowed sequences.", "kv_host_pages_used"),
            ("ninfer_kv_host_pages_free", "Host-memory KV pages free.", "kv_host_pages_free"),
            ("ninfer_kv_window_tokens", "Recent tokens a windowed sequence keeps on the GPU (0: no window).",
             "kv_window_tokens"),
            ("ninfer_kv_windowed_sequences", "Running sequences on the windowed (GPU window + host) path.",
             "kv_windowed_sequences"),
            ("ninfer_kv_retrieve_mib_per_second", "Host-to-GPU KV copy speed of retrieval (MiB per second of copying).",
             "kv_retrieve_mib_per_second"),
            ("ninfer_kv_retrieved_pages_per_step", "KV pages brought from host memory per engine step (one per layer; "
             "average since start).", "kv_retrieved_pages_per_step"),
            ("ninfer_kv_select_outside_mass", "KV retrieval unsureness: share of the Quest bound mass on pages left in "
             "host memory by page selection (average per selection since start; near 0: selection holds what "
             "attention could weigh).", "kv_select_outside_mass"),
            ("ninfer_kv_select_outside_mass_now", "KV retrieval unsureness now: the largest share of Quest bound mass "
             "left in host memory by a selection of a running windowed sequence's latest step.",
             "kv_select_outside_mass_now"),
            ("ninfer_spec_acceptance_ratio", "Speculative decoding: drafted tokens accepted / drafted (0 when off).",
             "spec_acceptance"),
            ("ninfer_spec_mean_accepted_tokens", "Speculative decoding: drafted tokens accepted per verification step.",
             "spec_mean_accepted"),
        ]
        for name, doc, key in gauges:
            yield GaugeMetricFamily(name, doc, value=stats[key])
        for kind in ("prefill", "decode"):
            g = GaugeMetricFamily(f"ninfer_{kind}_tokens_per_second",
                                  f"{kind.capitalize()} speed in tokens per engine second: window=lifetime since the "
                                  f"engine started, window=recent since the previous scrape.", labels=["window"])
            g.add_metric(["lifetime"], stats[f"{kind}_tokens_per_second"])
            g.add_metric(["recent"], stats[f"{kind}_tokens_per_second_recent"])
            yield g
        counters = [
            ("ninfer_preemptions", "Sequences preempted (their KV pages taken back) to make room.", "preemptions"),
            ("ninfer_engine_requests_submitted", "Requests the engine accepted.", "requests"),
            ("ninfer_engine_requests_finished", "Requests that ended normally (stop or length).", "finished"),
            ("ninfer_engine_requests_aborted", "Requests aborted (client gone, stop string, shutdown).", "aborted"),
            ("ninfer_engine_requests_failed", "Requests ended by an engine error.", "errors"),
            ("ninfer_prefill_tokens", "Prompt tokens processed.", "prefill_tokens"),
            ("ninfer_decode_tokens", "Tokens generated by decode steps.", "decode_tokens"),
            ("ninfer_prefill_seconds", "Engine seconds spent on prompt tokens.", "prefill_seconds"),
            ("ninfer_decode_seconds", "Engine seconds spent on decode tokens.", "decode_seconds"),
            ("ninfer_engine_steps", "Scheduler steps run.", "steps"),
            ("ninfer_prefix_hits", "Requests that reused a cached prompt prefix.", "prefix_hits"),
            ("ninfer_prefix_hit_tokens", "Prompt tokens served from cached prefixes instead of computed.",
             "prefix_hit_tokens"),
            ("ninfer_prefix_prompt_tokens", "Prompt tokens of admitted requests (the hit ratio's denominator).",
             "prefix_prompt_tokens"),
            ("ninfer_prefix_evicted_pages", "Cached prefix pages evicted (for room, or beyond --max-shared-prefixes).",
             "prefix_evicted_pages"),
            ("ninfer_prefix_partial_copies", "Cached pages copied into a new sequence's own page (copy on write).",
             "prefix_partial_copies"),
            ("ninfer_prefix_partial_tokens", "Prompt tokens served by copied pages (part of the hit tokens).",
             "prefix_partial_tokens"),
            ("ninfer_prefix_windowed_hit_tokens", "Prompt tokens of windowed sequences served from cached prefixes.",
             "prefix_windowed_hit_tokens"),
            ("ninfer_prefix_host_hit_tokens", "Prompt tokens served from prefix pages kept in host memory.",
             "prefix_host_hit_tokens"),
            ("ninfer_kv_retrieved_pages", "KV pages brought from host memory to the GPU by retrieval (one per layer).",
             "kv_retrieved_pages"),
            ("ninfer_kv_retrieved_bytes", "Bytes brought from host memory to the GPU by retrieval.",
             "kv_retrieved_bytes"),
            ("ninfer_kv_evictions", "GPU pages dropped from windowed sequences (their host copy stays).",
             "kv_evictions"),
            ("ninfer_kv_writethrough_pages", "Full KV pages written through to host memory.",
             "kv_writethrough_pages"),
            ("ninfer_spec_drafted_tokens", "Speculative decoding: tokens drafted.", "spec_drafted"),
            ("ninfer_spec_accepted_tokens", "Speculative decoding: drafted tokens the model accepted.", "spec_accepted"),
            ("ninfer_spec_verify_steps", "Speculative decoding: verification steps (decode steps with a draft).",
             "spec_steps"),
        ]
        for name, doc, key in counters:
            yield CounterMetricFamily(name, doc, value=stats[key])


def _template(routes, scope, prefix: str = "") -> str | None:
    """The path template of the route matching ``scope`` (method aside), looking into included routers; or None."""
    for r in routes:
        match, child = r.matches(scope)
        if match is Match.NONE:
            continue
        path = getattr(child.get("route"), "path", None) or getattr(r, "path", None)
        if path:
            return prefix + path
        inner = getattr(r, "original_router", None)  # FastAPI's include_router() entry
        if inner is not None:
            sub = getattr(getattr(r, "include_context", None), "prefix", "") or ""
            if scope["path"].startswith(sub):
                found = _template(inner.routes, {**scope, "path": scope["path"][len(sub):]}, prefix + sub)
                if found:
                    return found
    return None


class RequestCounter:
    """Pure-ASGI middleware counting HTTP answers by route template, method and status.

    Add it outermost (after the security middleware) so refusals (401, 403, 413) are counted too. The request is
    counted just before its last body message goes out, so a client that reads /metrics right after an answer
    always sees that answer counted; an exception before any answer counts as 500.
    """

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    @staticmethod
    def _route(scope) -> str:
        route = getattr(scope.get("route"), "path", None)  # set by the router for a routed request
        if route:
            return route
        try:  # refused before routing (security middleware): match the app's routes ourselves
            return _template(getattr(scope.get("app"), "routes", ()), scope) or OTHER_ROUTE
        except Exception:
            return OTHER_ROUTE

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, counted = None, False

        def count(code: int) -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.count_request(self._route(scope), scope.get("method", "GET"), code)

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                count(status or 500)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            count(status or 500)
