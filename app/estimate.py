"""A quick memory estimate for the launcher (Qt-free): model weights + KV cache + headroom against VRAM or RAM.

Kept deliberately simple until the engine's memory ledger exists: weights are the model's parameter count (read from
the GGUF tensor table or the safetensors headers, without loading anything; the file size when that fails) times the
bytes per weight the engine will hold (it dequantizes at load: fp32 on the CPU, bf16 on a GPU by default); the KV
cache is bytes per token (layers x KV heads x (K + V bytes per head), from the model's config and the KV format, as
the engine counts it) times the
tokens the cache will hold, decided the way ``engine.build.kv_pages`` decides it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAGE = 64  # tokens per KV page (engine.kv.cache.PAGE_SIZE, without importing torch here)
CPU_KV_RAM_FRACTION = 0.25  # engine.build.CPU_KV_RAM_FRACTION
MIB = 2**20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# (K, V) bytes per value for the KV formats, without quantization scales: a fallback when the engine cannot say
KV_BYTES = {"fp32": (4, 4), "bf16": (2, 2), "fp16": (2, 2), "k8v8": (1, 1), "k8v4": (1, 0.5), "k4v4": (0.5, 0.5),
            "rk4v4": (0.5, 0.5)}


def kv_bytes_per_token(cfg: Any, kv_dtype: str) -> int:
    """KV bytes one token takes over all layers: the engine's own count (scales included) when it knows the format."""
    try:
        from engine.kv.cache import KVCache
        return int(KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype))
    except Exception:  # an engine without this format (or without the helper): count the values
        k, v = KV_BYTES.get(kv_dtype, (4, 4))
        return int(cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (k + v))


@dataclass
class ModelInfo:
    path: Path
    kind: str  # "gguf" | "hf"
    config: Any  # engine.model.config.ModelConfig
    params: int  # 0 when unknown
    file_bytes: int

    @property
    def name(self) -> str:
        return self.config.name or self.path.name


_INFO_CACHE: dict[tuple, ModelInfo] = {}


def _safetensors_params(folder: Path) -> int:
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for d in entry.get("shape", []):
                    count *= int(d)
                total += count
    return total


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size


def model_info(path: str | Path) -> ModelInfo:
    """Reads a model's config and parameter count without loading weights; raises NInferError (ModelLoadError)
    with a remedy when the path is not a usable model. Cached by path, size and modification time."""
    from engine.errors import ModelLoadError
    from engine.model.loader import resolve_model_path

    p = resolve_model_path(str(path) if path else None)
    stat = p.stat()
    key = (str(p), stat.st_mtime_ns, stat.st_size)
    if key in _INFO_CACHE:
        return _INFO_CACHE[key]
    if p.is_dir():
        from engine.model.hf_folder import read_config
        cfg = read_config(p)
        try:
            params = _safetensors_params(p)
        except (OSError, ValueError, struct.error):
            params = 0
        info = ModelInfo(p, "hf", cfg, params, _size(p))
    else:
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{p.name} is neither a GGUF file nor a model folder.",
                                 "Pick a .gguf file, or a folder with config.json and *.safetensors.")
        from engine.model.gguf_file import hf_name, open_gguf, read_config
        reader = open_gguf(p)
        cfg = read_config(reader, p)
        params = sum(int(t.n_elements) for t in reader.tensors if hf_name(t.name) and hf_name(t.name) != "rope_freqs")
        info = ModelInfo(p, "gguf", cfg, params, stat.st_size)
    _INFO_CACHE[key] = info
    return info


@dataclass
class MemoryEstimate:
    device: str  # "cpu" or "cuda"
    total: int  # bytes of VRAM (GPU) or RAM (CPU)
    used_by_others: int  # already in use before the engine starts
    weights: int
    kv: int
    kv_tokens: int
    kv_bytes_per_token: int
    headroom: int  # kept free (GPU: --kv-headroom-mib)
    context: int
    weight_dtype: str
    kv_dtype: str
    problems: list[tuple[str, str]] = field(default_factory=list)  # (message, remedy), each an error

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def free_after(self) -> int:
        return self.total - self.used_by_others - self.weights - self.kv - self.headroom

    def summary(self) -> str:
        where = "VRAM" if self.device == "cuda" else "RAM"
        return (f"weights {self.weights / MIB:,.0f} MiB ({self.weight_dtype}) + KV {self.kv / MIB:,.0f} MiB "
                f"({self.kv_tokens:,} tokens × {self.kv_bytes_per_token / 1024:.1f} KiB, {self.kv_dtype}) + headroom "
                f"{self.headroom / MIB:,.0f} MiB of {self.total / MIB:,.0f} MiB {where}")


def _dtype(name: str, device: str) -> str:
    return ("bf16" if device == "cuda" else "fp32") if name == "auto" else name


def estimate(info: ModelInfo, settings: Any, report: Any) -> MemoryEstimate:
    """``settings``: effective engine Settings (or any object with the same attributes); ``report``: a
    HardwareReport (for the device, VRAM and RAM)."""
    cfg = info.config
    gpu = report.usable_gpu() if settings.device != "cpu" else None
    device = "cuda" if gpu is not None else "cpu"
    wdt, kdt = _dtype(settings.weight_dtype, device), _dtype(settings.kv_dtype, device)
    weights = info.params * DTYPE_BYTES.get(wdt, 4) if info.params else info.file_bytes
    per_token = kv_bytes_per_token(cfg, kdt)
    problems: list[tuple[str, str]] = []
    context = settings.max_context or cfg.max_position
    if settings.max_context > cfg.max_position:
        problems.append((f"max_context {settings.max_context} is beyond this model's trained context of "
                         f"{cfg.max_position} tokens.", f"Use {cfg.max_position} or less (0 = the model's own)."))
        context = cfg.max_position
    pages_per_seq = -(-context // PAGE)
    if gpu is not None:
        total = gpu.vram_total_mib * MIB
        free = (gpu.vram_free_mib if gpu.vram_free_mib is not None else gpu.vram_total_mib) * MIB
        headroom = settings.kv_headroom_mib * MIB
        budget = free - weights - headroom  # the engine measures free memory after loading the weights
    else:
        total = report.ram_total_mib * MIB
        free = report.ram_available_mib * MIB
        headroom = 0
        budget = int((free - weights) * CPU_KV_RAM_FRACTION)
    used = total - free
    page_bytes = per_token * PAGE
    if settings.kv_capacity != "auto":
        pages = max(-(-int(settings.kv_capacity) // PAGE), 1)
    else:
        fits = max(budget, 0) // page_bytes
        pages = min(pages_per_seq * settings.max_concurrency, fits)
        if fits < pages_per_seq:
            problems.append((f"The KV cache for one conversation of {context:,} tokens needs "
                             f"{pages_per_seq * page_bytes / MIB:,.0f} MiB, but only {max(budget, 0) / MIB:,.0f} MiB "
                             f"are left for it.", "Lower max_context, free memory (close other programs), or pick a "
                                                  "smaller model or weight format."))
    kv = pages * page_bytes
    if weights > free:
        problems.append((f"The weights need about {weights / MIB:,.0f} MiB but only {free / MIB:,.0f} MiB of "
                         f"{'VRAM' if gpu else 'RAM'} are free.",
                         "Pick a smaller model or a smaller weight format, or free memory."))
    elif weights + kv + headroom > free and settings.kv_capacity != "auto":
        problems.append((f"Weights ({weights / MIB:,.0f} MiB) + KV cache ({kv / MIB:,.0f} MiB for "
                         f"{pages * PAGE:,} tokens) + headroom ({headroom / MIB:,.0f} MiB) exceed the "
                         f"{free / MIB:,.0f} MiB free.", "Lower kv_capacity (or use auto), or lower max_context."))
    return MemoryEstimate(device, total, used, weights, kv, pages * PAGE, per_token, headroom, context, wdt, kdt,
                          problems)
