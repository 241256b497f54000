"""The app's HTTP client for any OpenAI-compatible server, the embedded one included (Qt-free, asyncio + httpx).

``ApiClient.stream_chat()`` yields ``ChatEvent``s from ``POST /v1/chat/completions`` with ``stream: true``
(content, reasoning, tool calls, finish, usage, error); cancelling the task that iterates it closes the connection,
which aborts the request on the server. ``metrics()`` reads ``GET /metrics`` (Prometheus text) into the numbers the
monitor plots, for NInfer and for the names vLLM and llama.cpp servers use; ``settings()`` / ``put_settings()`` use
NInfer's ``/ninfer/v1/settings`` (other servers answer 404: the mode switch is then unavailable). ``shared_url()``
is the API's address to give out: with the embedded server open to the network, the one other computers use.
"""
from __future__ import annotations

import json
import math
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

SETTINGS_PATH = "/ninfer/v1/settings"
ALL_INTERFACES = ("0.0.0.0", "::", "", "*")  # a server bound to one of these listens on the network too


def lan_addresses() -> list[str]:
    """This computer's IPv4 addresses other computers on the network can reach (no loopback), best first."""
    found: list[str] = []
    try:  # the address of the interface a packet to the outside would leave by (nothing is sent)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            found.append(s.getsockname()[0])
    except OSError:
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.append(info[4][0])
    except OSError:
        pass
    return [a for a in dict.fromkeys(found) if not a.startswith("127.") and a != "0.0.0.0"]


def shared_url(service) -> str:
    """The OpenAI base URL to give out for the embedded server ``service`` (its host, port and url): bound to every
    interface (open to the network), http://LAN-ADDRESS:PORT/v1 with this computer's first LAN address, what other
    computers use (and this one too); otherwise ``service.url`` (bound to one address: that address)."""
    if (service.host or "").strip().strip("[]") in ALL_INTERFACES:
        lan = lan_addresses()
        if lan:
            return f"http://{lan[0]}:{service.port}/v1"
    return service.url


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # http://host:port (the OpenAI base URL is this + /v1)
    api_key: str | None = None
    local: bool = False

    @staticmethod
    def parse(url: str, api_key: str | None = None, local: bool = False) -> "Endpoint":
        """Accepts http://host:port, http://host:port/v1 or host:port."""
        url = url.strip().rstrip("/")
        if not re.match(r"^https?://", url):
            url = "http://" + url
        if url.endswith("/v1"):
            url = url[:-3]
        return Endpoint(url, api_key or None, local)

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class ChatEvent:
    kind: str  # content | reasoning | tool_calls | finish | usage | error
    text: str = ""
    data: Any = None


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}" if status else message)


def _error_text(response: httpx.Response, body: bytes | None = None) -> str:
    raw = body if body is not None else response.content
    try:
        data = json.loads(raw)
        return data.get("error", {}).get("message") or data.get("detail") or raw.decode(errors="replace")
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:500] or response.reason_phrase


class ApiClient:
    def __init__(self, endpoint: Endpoint, timeout: float = 10.0):
        self.endpoint = endpoint
        self.http = httpx.AsyncClient(base_url=endpoint.base_url, headers=endpoint.headers(),
                                      timeout=httpx.Timeout(timeout, read=None), trust_env=False)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def health(self) -> tuple[int, dict]:
        r = await self.http.get("/health", timeout=5.0)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {}

    async def models(self) -> list[dict]:
        r = await self.http.get("/v1/models", timeout=5.0)
        if r.status_code != 200:
            raise ApiError(r.status_code, _error_text(r))
        return list(r.json().get("data", []))

    async def settings(self) -> dict | None:
        """NInfer's live settings (mode, sampling in force), or None when the server has no such route."""
        r = await self.http.get(SETTINGS_PATH, timeout=5.0)
        if r.status_code in (404, 405):
            return None
        if r.status_code != 200:
            raise ApiError(r.status_code, _error_text(r))
        return r.json()

    async def put_settings(self, changes: dict) -> dict:
        r = await self.http.put(SETTINGS_PATH, json=changes)
        if r.status_code != 200:
            raise ApiError(r.status_code, _error_text(r))
        return r.json()

    async def metrics(self) -> "MetricsReading":
        try:
            r = await self.http.get("/metrics", timeout=5.0)
        except httpx.HTTPError as e:
            return MetricsReading(False, f"cannot reach {self.endpoint.base_url}/metrics ({type(e).__name__})")
        if r.status_code != 200:
            return MetricsReading(False, f"this server does not offer /metrics (HTTP {r.status_code})")
        return read_metrics(r.text)

    async def stream_chat(self, model: str, messages: list[dict], **params: Any) -> AsyncIterator[ChatEvent]:
        body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                **{k: v for k, v in params.items() if v is not None}}
        calls: dict[int, dict] = {}
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise ApiError(r.status_code, _error_text(r, await r.aread()))
            async for line in r.aiter_lines():  # read to the end: the connection then goes back to the pool
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    continue
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    yield ChatEvent("error", str(chunk["error"].get("message", chunk["error"])))
                    return
                if chunk.get("usage"):
                    yield ChatEvent("usage", data=chunk["usage"])
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                    if reasoning:
                        yield ChatEvent("reasoning", reasoning)
                    if delta.get("content"):
                        yield ChatEvent("content", delta["content"])
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(tc.get("index", len(calls)),
                                                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                        yield ChatEvent("tool_calls", data=[calls[i] for i in sorted(calls)])
                    if choice.get("finish_reason"):
                        yield ChatEvent("finish", choice["finish_reason"])


# ---------------------------------------------------------------- /metrics

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:\\.|[^"\\])*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {metric name: [(labels, value), ...]} (comments skipped)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


@dataclass
class MetricsReading:
    available: bool
    note: str = ""  # why nothing is available, or which server flavour was read
    values: dict[str, float | None] = field(default_factory=dict)  # the keys of app.monitor.model.local_values
    time: float = field(default_factory=time.time)


def _first(metrics: dict, *names: str, label: tuple[str, str] | None = None) -> float | None:
    for name in names:
        for labels, value in metrics.get(name, []):
            if label is None or labels.get(label[0]) == label[1]:
                return value if math.isfinite(value) else None
    return None


_counters: dict[str, tuple[float, float]] = {}  # (server, counter) -> (time, value), for rates of other servers


def _rate(key: str, value: float | None) -> float | None:
    if value is None:
        return None
    now = time.monotonic()
    previous = _counters.get(key)
    _counters[key] = (now, value)
    if previous is None or now <= previous[0] or value < previous[1]:
        return None
    return (value - previous[1]) / (now - previous[0])


def _vllm_prefix_ratio(m: dict) -> float | None:
    """vLLM's prefix-cache hit ratio: the gauge of older versions, or hits / queries (token counters) of newer ones."""
    gauge = _first(m, "vllm:gpu_prefix_cache_hit_rate")
    if gauge is not None:
        return gauge
    hits, queries = _first(m, "vllm:prefix_cache_hits_total"), _first(m, "vllm:prefix_cache_queries_total")
    return hits / queries if hits is not None and queries else None


def read_metrics(text: str, server: str = "") -> MetricsReading:
    """The monitor's numbers from a /metrics body: NInfer's own names, else vLLM's or llama.cpp's."""
    m = parse_prometheus(text)
    if "ninfer_engine_attached" in m:
        if not _first(m, "ninfer_engine_attached"):
            return MetricsReading(True, "NInfer: the model is still loading", {})
        drafted = _first(m, "ninfer_spec_drafted_tokens_total", "ninfer_spec_drafted_total", "ninfer_spec_drafted")
        accepted = _first(m, "ninfer_spec_accepted_tokens_total", "ninfer_spec_accepted_total",
                          "ninfer_spec_accepted")
        return MetricsReading(True, "NInfer", {
            "decode_tps": _first(m, "ninfer_decode_tokens_per_second", label=("window", "recent")),
            "pages_used": _first(m, "ninfer_kv_pages_used"), "pages_free": _first(m, "ninfer_kv_pages_free"),
            "running": _first(m, "ninfer_requests_running"), "waiting": _first(m, "ninfer_requests_waiting"),
            "prefix_hit_ratio": _first(m, "ninfer_prefix_hit_ratio"),
            "prefix_cached_pages": _first(m, "ninfer_prefix_cached_pages"),
            "host_pages_used": _first(m, "ninfer_kv_host_pages_used"),
            "host_pages_free": _first(m, "ninfer_kv_host_pages_free"),
            "select_outside": _first(m, "ninfer_kv_select_outside_mass_now"),
            "retrieved_pps": _rate(server + "ninfer_retrieved", _first(m, "ninfer_kv_retrieved_pages_total",
                                                                             "ninfer_kv_retrieved_pages")),
            "spec_drafted": drafted, "spec_accepted": accepted,
            "spec_acceptance": _first(m, "ninfer_spec_acceptance_ratio", "ninfer_spec_acceptance"),
            "spec_mean_accepted": _first(m, "ninfer_spec_mean_accepted_tokens")})
    if any(k.startswith("vllm:") for k in m):
        usage = _first(m, "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")
        return MetricsReading(True, "vLLM (KV shown as % used)", {
            "decode_tps": _rate(server + "vllm_gen", _first(m, "vllm:generation_tokens_total")),
            "pages_used": None if usage is None else usage * 100, "pages_free": None if usage is None else 100 - usage * 100,
            "running": _first(m, "vllm:num_requests_running"), "waiting": _first(m, "vllm:num_requests_waiting"),
            "prefix_hit_ratio": _vllm_prefix_ratio(m),
            "spec_drafted": _first(m, "vllm:spec_decode_num_draft_tokens_total"),
            "spec_accepted": _first(m, "vllm:spec_decode_num_accepted_tokens_total")})
    if any(k.startswith("llamacpp:") for k in m):
        usage = _first(m, "llamacpp:kv_cache_usage_ratio")
        return MetricsReading(True, "llama.cpp (KV shown as % used)", {
            "decode_tps": _first(m, "llamacpp:predicted_tokens_seconds"),
            "pages_used": None if usage is None else usage * 100, "pages_free": None if usage is None else 100 - usage * 100,
            "running": _first(m, "llamacpp:requests_processing"), "waiting": _first(m, "llamacpp:requests_deferred")})
    return MetricsReading(False, "this server's /metrics has none of the numbers this monitor knows "
                                 "(NInfer, vLLM or llama.cpp names)")
