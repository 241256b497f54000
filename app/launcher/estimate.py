"""The launcher's memory plan (Qt-free): the engine's own memory ledger (``engine.ledger``) for the chosen model,
settings and this machine, and the stacked bars the launcher draws from it.

Nothing is counted here: the ledger gives every line (weights, draft, KV pages, headroom, activations, host KV, ...)
with the same arithmetic ``ninfer-doctor --ledger`` prints, and the KV bytes per token of each KV format (codes and
scales of the quantized ones) from its layout table. This module only reads the model's metadata (no weights are
loaded), picks the budgets the way ``ninfer-doctor --ledger`` does (the free VRAM of the usable GPU, the available
RAM) and groups the lines into bars: weights / draft / KV GPU / headroom against VRAM, host KV against RAM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.ledger import Ledger, ModelShape, build_ledger
from engine.model.inspect import ModelInfo as Inspected, inspect, runnable

MIB = 2**20

# How the ledger's lines are grouped into the bars' segments, in drawing order: (segment key, label, line keys)
# (a hybrid's recurrent state, a fixed size per sequence, is a segment of its own: its slots, and its prefix
# snapshots in host memory)
# (a vision model's tower counts with the weights, its activations and encoder cache with the workspace)
SEGMENTS = (("weights", "weights", ("weights", "vision")), ("draft", "draft", ("draft", "draft_kv")),
            ("kv", "KV", ("kv",)), ("host_kv", "host KV", ("host_kv",)),
            ("state", "recurrent state", ("state", "state_snapshots")),
            ("other", "workspace", ("activations", "runtime", "vision_activations", "encoder_cache")),
            ("headroom", "headroom", ("headroom",)))


@dataclass
class ModelInfo:
    """A model's metadata (engine.model.inspect) and the shape the memory ledger plans for."""
    meta: Inspected
    shape: ModelShape

    @property
    def path(self) -> Path:
        return self.meta.path

    @property
    def kind(self) -> str:  # "gguf" | "hf"
        return self.meta.kind

    @property
    def config(self) -> Any:  # engine.model.config.ModelConfig
        return self.meta.config

    @property
    def file_bytes(self) -> int:
        return self.meta.file_bytes

    @property
    def name(self) -> str:
        return self.config.name or self.path.name

    @property
    def params(self) -> int:
        return self.shape.params


def model_info(path: str | Path | None) -> ModelInfo:
    """Reads a model's config and shape without loading weights; raises NInferError (ModelLoadError) with a remedy
    when the path is not a usable model. An ``hf:ORG/REPO[:QUANT]`` reference is looked up in the hub cache only: a
    check never downloads."""
    from engine.library.resolve import is_hf_spec, resolve_hf

    p = resolve_hf(str(path), download_missing=False) if is_hf_spec(path) else path
    meta = runnable(inspect(p))  # the launcher starts only what the engine runs
    return ModelInfo(meta, ModelShape.from_info(meta))


# ---------------------------------------------------------------- the bars

@dataclass(frozen=True)
class Segment:
    key: str  # weights | draft | kv | host_kv | other | headroom
    label: str
    bytes: int
    reserved: bool = False  # kept free, not allocated (the headroom)


@dataclass(frozen=True)
class Bar:
    """One device: its memory, what other programs already use, the ledger's lines, and the ledger's budget."""

    device: str  # "gpu" | "host"
    title: str  # "VRAM" | "RAM"
    capacity: int  # the device's total memory
    others: int  # already in use before the engine starts (capacity - budget)
    budget: int  # what the ledger plans against: free VRAM / available RAM
    segments: tuple[Segment, ...]

    @property
    def planned(self) -> int:
        return sum(s.bytes for s in self.segments)

    @property
    def over(self) -> int:
        """Bytes beyond the budget (0 when it fits)."""
        return max(self.planned - self.budget, 0)

    def text(self) -> str:
        parts = " + ".join(f"{s.label} {s.bytes / MIB:,.0f}" for s in self.segments if s.bytes)
        verdict = f", {self.over / MIB:,.0f} MiB over" if self.over else ""
        return f"{self.title}: {parts} MiB of {self.budget / MIB:,.0f} MiB free{verdict}"


@dataclass
class MemoryEstimate:
    ledger: Ledger
    device: str  # "cuda" or "cpu": where the weights and the KV pool go
    capacity: dict[str, int]  # ledger device -> total memory of that device
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (level, message, remedy)
    notes: list[str] = field(default_factory=list)

    # -- the numbers the launcher shows, all from the ledger
    def _line(self, key: str) -> int:
        line = self.ledger.line(key)
        return line.bytes if line else 0

    @property
    def weights(self) -> int:
        return self._line("weights")

    @property
    def draft(self) -> int:
        return self._line("draft") + self._line("draft_kv")

    @property
    def kv(self) -> int:
        return self._line("kv")

    @property
    def host_kv(self) -> int:
        return self._line("host_kv")

    @property
    def state(self) -> int:
        """A hybrid model's recurrent-state slots (0 for attention-only models)."""
        return self._line("state")

    @property
    def headroom(self) -> int:
        return self._line("headroom")

    @property
    def kv_tokens(self) -> int:
        return self.ledger.kv_capacity_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        return self.ledger.page_bytes // self.ledger.page_size

    @property
    def context(self) -> int:
        return self.ledger.max_context

    @property
    def weight_dtype(self) -> str:
        return self.ledger.weight_dtype

    @property
    def weight_format(self) -> str:
        """The weights' format in words: the dtype asked for, or what the file stores (auto)."""
        if self.ledger.weight_dtype != "auto":
            return self.ledger.weight_dtype
        return f"as stored ({self.ledger.shape.stored_format})" if self.ledger.shape.stored_format else "as stored"

    @property
    def kv_dtype(self) -> str:
        return self.ledger.kv_dtype

    @property
    def total(self) -> int:
        """Total memory of the device the KV pool lives on."""
        return self.capacity[self.ledger.kv_device]

    @property
    def fits(self) -> bool:
        return not any(level == "error" for level, _, _ in self.problems)

    def bars(self) -> list[Bar]:
        """One bar per device: VRAM (weights / draft / KV GPU / state / workspace / headroom) and RAM (host KV,
        state snapshots, runtime; or everything when there is no GPU)."""
        out = []
        for device, budget in self.ledger.budgets.items():
            lines = self.ledger.device_lines(device)
            segments = []
            for key, label, keys in SEGMENTS:
                size = sum(line.bytes for line in lines if line.key in keys)
                if key == "kv" and device == "gpu":
                    label = "KV GPU"
                if key == "state" and device == "host" and "gpu" in self.ledger.budgets:
                    label = "state snapshots"
                if key == "other" and any(line.key == "runtime" for line in lines):
                    label = "runtime + workspace"
                if size:
                    segments.append(Segment(key, label, size, reserved=key == "headroom"))
            capacity = max(self.capacity.get(device, budget), budget)
            out.append(Bar(device, "VRAM" if device == "gpu" else "RAM", capacity, capacity - budget, budget,
                           tuple(segments)))
        return out

    def fit_text(self) -> str:
        """One line for the checks: what is planned against what is free, per device."""
        return "; ".join(f"{bar.planned / MIB:,.0f} MiB planned of {bar.budget / MIB:,.0f} MiB free {bar.title}"
                         for bar in self.bars())

    def summary(self) -> str:
        return (f"KV {self.kv_tokens:,} tokens × {self.kv_bytes_per_token:,} B ({self.kv_dtype}); weights "
                f"{self.weight_format}; " + "; ".join(bar.text() for bar in self.bars()))


def estimate(info: ModelInfo, settings: Any, report: Any) -> MemoryEstimate:
    """The ledger of ``info``'s model under ``settings`` (effective engine Settings, or any object with the same
    attributes) on the machine ``report`` describes (a HardwareReport): the usable GPU's free VRAM (none when the
    device is cpu) and the available RAM, as ``ninfer-doctor --ledger`` plans."""
    from engine.errors import NInferError

    gpu = report.usable_gpu() if settings.device != "cpu" else None
    vram_total = gpu.vram_total_mib if gpu is not None else 0
    vram_free = (gpu.vram_free_mib if gpu.vram_free_mib is not None else gpu.vram_total_mib) if gpu else 0
    ram_total, ram_free = report.ram_total_mib, report.ram_available_mib
    try:
        shape = info.shape.on_device(gpu is not None, settings.weight_dtype)  # a hybrid's conv window dtype
        ledger, placed = placed_ledger(shape, settings, gpu is not None, int(vram_free), int(ram_free))
    except NInferError as e:  # e.g. a draft model that cannot be read
        raise ValueError(f"{e.problem} {e.remedy}".strip()) from None
    capacity = {"host": int(ram_total) * MIB}
    if gpu is not None:
        capacity["gpu"] = int(vram_total) * MIB
    problems = [(p.level, p.message, p.remedy) for p in ledger.check()]
    notes = list(ledger.notes) + ([f"Fit (MoE experts placed as the engine will place them): {placed}"]
                                  if placed else [])
    return MemoryEstimate(ledger, "cuda" if gpu is not None else "cpu", capacity, problems, notes)


def placed_ledger(shape: ModelShape, settings: Any, on_gpu: bool, vram_mib: int, ram_mib: int) -> tuple[Ledger, str]:
    """The ledger of the model as the engine will load it, and what --fit chose ("" when it chose nothing): on a GPU,
    with --fit and neither --cpu-moe nor --n-cpu-moe, a MoE model's experts and KV dtype are placed by the same plan
    the engine's load runs (engine/ledger/placement.py), so the bars show that plan, not everything on the GPU."""
    from engine.ledger.placement import fit_experts

    asked = getattr(settings, "cpu_moe", False) or getattr(settings, "n_cpu_moe", 0)
    if not (on_gpu and shape.moe_layers and getattr(settings, "fit", False) and not asked):
        return build_ledger(shape, settings, vram_mib=vram_mib, ram_mib=ram_mib), ""
    plan = fit_experts(shape, settings, vram_mib=vram_mib, ram_mib=ram_mib)
    return plan.ledger, plan.why
