"""What the monitor shows, Qt-free: one sample of numbers from the engine's stats (or a remote server's /metrics), the
rates computed between samples, and the text of each card. Keys an engine does not report (KV host tier,
speculative decoding) are read with ``.get``: the cards then say the feature is not running instead of failing.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

RATE_WINDOW = 5  # samples the local rates are averaged over (a single second is too jumpy on a slow machine)


class Rates:
    """Rates of the engine's cumulative counters over the last few samples: decode tokens per engine-second and
    KV pages retrieved from host memory per second."""

    def __init__(self, window: int = RATE_WINDOW):
        self.decode: deque = deque(maxlen=window + 1)  # (decode tokens, decode engine-seconds)
        self.retrieved: deque = deque(maxlen=window + 1)  # (wall time, pages retrieved)

    def decode_rate(self, s: dict) -> float | None:
        """Decode tokens per engine-second over the last few samples (0 while idle)."""
        tokens, seconds = s.get("decode_tokens"), s.get("decode_seconds")
        if tokens is None or seconds is None:
            self.decode.clear()
            return None
        if self.decode and tokens < self.decode[-1][0]:  # a new engine: start over
            self.decode.clear()
        self.decode.append((tokens, seconds))
        t0, s0 = self.decode[0]
        return (tokens - t0) / (seconds - s0) if tokens > t0 and seconds > s0 else 0.0

    def retrieved_rate(self, s: dict, now: float) -> float | None:
        pages = s.get("kv_retrieved_pages")
        if not isinstance(pages, (int, float)):
            self.retrieved.clear()
            return None
        if self.retrieved and pages < self.retrieved[-1][1]:
            self.retrieved.clear()
        self.retrieved.append((now, pages))
        t0, p0 = self.retrieved[0]
        return (pages - p0) / (now - t0) if now > t0 else 0.0


def api_requests(s: dict) -> int | None:
    """Requests answered on the API routes (/v1/...): not /health, /metrics or the settings, which the app itself
    polls every second."""
    by_route = s.get("http_requests")
    if not isinstance(by_route, dict):
        return None
    return sum(n for route, statuses in by_route.items() if str(route).startswith("/v1/")
               for n in statuses.values())


def local_values(s: dict, rates: Rates, now: float) -> dict:
    """The monitor's numbers from ``LocalService.stats()`` (the metrics snapshot plus Engine.stats())."""
    ttft = (s.get("ttft_seconds") or {}).get("p50")
    values = {"decode_tps": rates.decode_rate(s), "decode_tps_avg": s.get("decode_tokens_per_second"),
              "pages_used": s.get("pages_used"), "pages_free": s.get("pages_free"), "running": s.get("running"),
              "waiting": s.get("waiting"), "ttft_p50": ttft, "requests": api_requests(s),
              "prefix_hit_ratio": s.get("prefix_hit_ratio"), "prefix_cached_pages": s.get("prefix_cached_pages"),
              "host_pages_used": None, "host_pages_free": None, "retrieved_pages": None, "retrieved_pps": None,
              "select_outside": None}
    host_used, host_free = s.get("kv_host_pages_used"), s.get("kv_host_pages_free")
    if _is_num(host_used, host_free) and host_used + host_free > 0:  # the engine runs a host tier
        values.update(host_pages_used=host_used, host_pages_free=host_free,
                      retrieved_pages=s.get("kv_retrieved_pages"), retrieved_pps=rates.retrieved_rate(s, now),
                      select_outside=s.get("kv_select_outside_mass_now"))
    for key in ("spec_method", "spec_drafted", "spec_accepted", "spec_acceptance", "spec_mean_accepted"):
        values[key] = s.get(key)
    return values


@dataclass(frozen=True)
class Card:
    value: str
    detail: str = ""


def _num(x, fmt: str) -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "—"


def _is_num(*xs) -> bool:
    return all(isinstance(x, (int, float)) for x in xs)


def cards(v: dict, available: bool = True, vram_note: str = "", vram_name: str = "") -> dict[str, Card]:
    """The text of each card: decode, kv, prefix, spec, requests, vram (RAM without a GPU), cpu."""
    out: dict[str, Card] = {}
    details = []
    if v.get("decode_tps_avg"):
        details.append(f"average {v['decode_tps_avg']:.1f} tok/s")
    if v.get("ttft_p50") is not None:
        details.append(f"TTFT p50 {v['ttft_p50']:.2f} s")
    out["decode"] = Card(_num(v.get("decode_tps"), "{:.1f} tok/s"), " · ".join(details))

    used, free = v.get("pages_used"), v.get("pages_free")
    host_used, host_free = v.get("host_pages_used"), v.get("host_pages_free")
    kv_details = []
    if _is_num(used, free):
        kv_details.append("GPU pages used / total" if _is_num(host_used, host_free) else "pages used / total")
    if _is_num(host_used, host_free) and host_used + host_free > 0:
        kv_details.append(f"host {host_used:,.0f} / {host_used + host_free:,.0f} pages")
    if _is_num(v.get("retrieved_pps")):
        kv_details.append(f"retrieved {v['retrieved_pps']:.1f} pages/s")
    if _is_num(v.get("select_outside")) and v["select_outside"] > 0:
        # the share of attention mass (Quest's bound) left on pages retrieval did not bring back: retrieval straining
        kv_details.append(f"retrieval leaves {100 * v['select_outside']:.0f}% of attention out")
    if _is_num(used, free):
        out["kv"] = Card(f"{used:,.0f} / {used + free:,.0f}", " · ".join(kv_details))
    else:
        out["kv"] = Card("—", "not reported" if available else "")

    ratio = v.get("prefix_hit_ratio")
    if _is_num(ratio):
        cached = v.get("prefix_cached_pages")
        out["prefix"] = Card(f"{ratio:.0%}", "of prompt tokens reused"
                             + (f" · {cached:,.0f} pages cached" if _is_num(cached) else ""))
    else:
        out["prefix"] = Card("—", "not reported" if available else "")

    drafted, acceptance = v.get("spec_drafted"), v.get("spec_acceptance")
    if _is_num(drafted) and drafted > 0:
        if not _is_num(acceptance) and _is_num(v.get("spec_accepted")):
            acceptance = v["spec_accepted"] / drafted
        mean = v.get("spec_mean_accepted")
        out["spec"] = Card(_num(acceptance, "{:.0%}") + (" accepted" if _is_num(acceptance) else ""),
                           f"{drafted:,.0f} tokens drafted"
                           + (f" · {mean:.2f} accepted per step" if _is_num(mean) else ""))
    else:
        method = v.get("spec_method")
        if method and method != "none":
            detail = f"--spec {method}: no draft tokens yet"
        else:
            detail = "speculative decoding is off" if method == "none" or not _is_num(drafted) else \
                "no draft tokens yet"
        out["spec"] = Card("not running", detail)

    out["requests"] = Card(_num(v.get("running"), "{:.0f} running"),
                           _num(v.get("waiting"), "{:.0f} waiting")
                           + (f" · {v['requests']:,} API requests" if v.get("requests") is not None else ""))
    if v.get("vram_total"):
        out["vram"] = Card(f"{v['vram_used']:,.0f} MiB", f"of {v['vram_total']:,.0f} MiB · {vram_name}")
    elif _is_num(v.get("ram_used")):
        system = (f" · {v['ram_system_used'] / 1024:,.1f} of {v['ram_system_total'] / 1024:,.1f} GiB in use"
                  if _is_num(v.get("ram_system_used"), v.get("ram_system_total")) else "")
        out["vram"] = Card(f"{v['ram_used']:,.0f} MiB", "NInfer" + system)
    else:
        out["vram"] = Card("—", vram_note or "no NVIDIA GPU")
    if _is_num(v.get("cpu_process")):
        out["cpu"] = Card(f"{v['cpu_process']:.0f}%", "NInfer"
                          + (f" · all: {v['cpu_system']:.0f}%" if _is_num(v.get("cpu_system")) else "")
                          + (f" of {v['cpu_cores']} cores" if v.get("cpu_cores") else ""))
    else:
        out["cpu"] = Card("—", "not measured")
    return out


class HostReader:
    """This computer's RAM and CPU use, and the app's own (psutil): what the monitor shows beside or instead of VRAM."""

    def __init__(self):
        try:
            import psutil
            self._psutil = psutil
            self._process = psutil.Process()
            self._process.cpu_percent(None)  # the first reading starts the interval
            psutil.cpu_percent(None)
        except Exception:  # psutil missing or the process not readable: the cards say "not measured"
            self._psutil = None

    def read(self) -> dict:
        ps = self._psutil
        if ps is None:
            return {}
        try:
            mem = ps.virtual_memory()
            cores = ps.cpu_count() or 1
            return {"ram_used": self._process.memory_info().rss / 2**20, "ram_system_used": (mem.total - mem.available)
                    / 2**20, "ram_system_total": mem.total / 2**20,
                    "cpu_process": self._process.cpu_percent(None) / cores, "cpu_system": ps.cpu_percent(None),
                    "cpu_cores": cores}
        except Exception:
            return {}


class VramReader:
    """Used and total VRAM of GPU 0 through NVML; ``note`` says why there is none."""

    def __init__(self):
        self.handle = None
        self.name = ""
        self.note = ""
        self.detail = ""
        try:
            import pynvml
            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() < 1:
                self.note = "no NVIDIA GPU"
                return
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self._nvml = pynvml
        except Exception as e:  # ImportError, NVMLError (no driver, no GPU)
            reason = str(e) or type(e).__name__
            self.detail = reason  # for the tooltip and the log, not the card
            self.note = ("no NVIDIA GPU (no NVIDIA driver found)" if "Library Not Found" in reason or
                         isinstance(e, ImportError) else "no NVIDIA GPU found")

    def read(self) -> tuple[float, float] | None:
        if self.handle is None:
            return None
        try:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self.handle)
            return mem.used / 2**20, mem.total / 2**20
        except Exception as e:
            self.note = f"NVML error: {e}"
            return None
