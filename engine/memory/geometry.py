"""The numbers every part of the engine agrees on, in one torch-free module (the KV cache, the ledger and the app
read them here): the page size, a KV window's footprint, the bytes of each KV dtype, and which KV-tier settings
work together.

The KV byte layout is the contract engine/memory/kv/quant.py allocates (tests/engine/test_kv_quant.py checks the tensors
it allocates against these counts); the window footprint is what a windowed sequence takes from the GPU pool
(engine/memory/kv/window.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine.memory.dtypes import FLOAT_FORMATS, auto_float

PAGE_SIZE = 64  # tokens a KV page holds


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


@dataclass(frozen=True)
class WindowSpec:
    window: int  # tokens of recent context kept on the GPU (a multiple of page_size)
    retrieve: int  # tokens of older context brought back per layer and step (a multiple of page_size)
    ring: str  # auto: window a sequence when it outgrows the window; on: from its start; off: never
    chunk: int  # the most tokens one step computes for a sequence (the prefill chunk)
    page_size: int = PAGE_SIZE

    @staticmethod
    def round(tokens: int, page_size: int = PAGE_SIZE) -> int:
        return pages_for(tokens, page_size) * page_size

    @classmethod
    def from_settings(cls, v: Mapping[str, Any] | Any) -> "WindowSpec":
        """From settings (a mapping or an object with kv_window, kv_retrieve, prefill_chunk and maybe kv_ring)."""
        get = v.get if isinstance(v, Mapping) else lambda n, d=None: getattr(v, n, d)
        return cls(cls.round(get("kv_window")), cls.round(get("kv_retrieve")), get("kv_ring", "auto") or "auto",
                   get("prefill_chunk"))

    @property
    def retrieve_pages(self) -> int:
        return self.retrieve // self.page_size

    @property
    def lossy(self) -> bool:
        """Older context outside the window is never attended to again."""
        return self.retrieve_pages == 0

    @property
    def footprint(self) -> int:
        """GPU pages one windowed sequence owns: sink + window and step pages (+2 for unaligned edges) + staging."""
        return 1 + pages_for(self.window + self.chunk, self.page_size) + 2 + self.retrieve_pages

    def footprint_text(self) -> str:
        return (f"{self.footprint} pages: sink 1 + window and step {self.footprint - 1 - self.retrieve_pages} + "
                f"retrieved {self.retrieve_pages}")

    def windowed(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` tokens (KV included for the next one) runs on the tiered path."""
        return self.ring == "on" or (self.ring == "auto" and tokens > self.window)


def sequence_reach(gpu_pages: int, host_pages: int, window: int, ring: str,
                   page_size: int = PAGE_SIZE) -> tuple[int, int | None]:
    """Tokens one sequence can hold when it has the pools to itself: (in the device pool alone, with the host tier
    or None where there is none). A window caps the device part; a windowed sequence writes every full page through
    to the host, so the host pool is its reach (with ring auto, a sequence within the window needs no host page).
    The one formula: the ledger plans with it, engine/memory/kv/window.plan_tiers runs with it."""
    gpu = gpu_pages * page_size
    if window <= 0:
        return gpu, None
    on_device = min(WindowSpec.round(window, page_size), gpu)
    if ring == "off" or not host_pages:
        return on_device, None
    host = host_pages * page_size
    return on_device, host if ring == "on" else max(host, on_device)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """Bytes of one KV dtype. ``*_group``: elements sharing a scale along head_dim; 0 = one scale per token per head,
    None = floating point (no scale)."""

    name: str
    k_bits: int
    v_bits: int
    k_group: int | None
    v_group: int | None
    scale_bytes: int = 2
    rotated_k: bool = False
    planning_only: bool = False

    def _part(self, bits: int, group: int | None, head_dim: int) -> int:
        values = ceil_div(head_dim * bits, 8)
        if group is None:
            return values
        if group:  # the largest even divisor of D up to the group (engine.memory.kv.quant.group_size); 32 for D = 64, 256
            group = max((g for g in range(2, min(group, head_dim) + 1, 2) if head_dim % g == 0), default=head_dim)
        groups = 1 if group == 0 else head_dim // group
        return values + groups * self.scale_bytes

    def bytes_per_head(self, head_dim: int) -> int:
        """K plus V bytes of one token in one KV head."""
        return self._part(self.k_bits, self.k_group, head_dim) + self._part(self.v_bits, self.v_group, head_dim)

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int) -> int:
        return layers * kv_heads * self.bytes_per_head(head_dim)


KV_LAYOUTS: dict[str, KVLayout] = {
    **{f.name: KVLayout(f.name, f.bits, f.bits, None, None) for f in FLOAT_FORMATS.values()},
    "k8v8": KVLayout("k8v8", 8, 8, 0, 0),
    "k8v4": KVLayout("k8v4", 8, 4, 0, 32),
    "k4v4": KVLayout("k4v4", 4, 4, 32, 32),
    "rk4v4": KVLayout("rk4v4", 4, 4, 32, 32, rotated_k=True),
    "k4v4-e8": KVLayout("k4v4-e8", 4, 4, 32, 32, scale_bytes=1, planning_only=True),
    "rk4v4-e8": KVLayout("rk4v4-e8", 4, 4, 32, 32, scale_bytes=1, rotated_k=True, planning_only=True),
}
KV_DTYPES = ("auto", *KV_LAYOUTS)


def resolve_kv_dtype(name: str, on_gpu: bool) -> str:
    """The one resolver of a KV dtype's name: ``auto`` is what engine.model.formats.pick_dtype picks for the
    activations, bf16 on a GPU, fp32 on the CPU (engine.model.formats.pick_kv_dtype turns the name into what the
    KV cache takes; the ledger plans with the name)."""
    if name == "auto":
        return auto_float(on_gpu).name
    if name not in KV_LAYOUTS:
        raise ValueError(f"unknown KV dtype {name!r}; one of {', '.join(KV_DTYPES)}")
    return name


@dataclass(frozen=True)
class TierProblem:
    """A KV window / host tier / ring combination that cannot work: the settings involved, what is wrong, and the
    remedy (both in the flags' words)."""
    settings: tuple[str, ...]
    message: str
    remedy: str

    def __str__(self) -> str:
        return f"{self.message}; {self.remedy}"


def tier_problems(v: Mapping[str, Any]) -> list[TierProblem]:
    """Every rule on the KV-tier settings, in one place: engine.config.loading reports them all before anything loads
    (`kv_capacity` an int or "auto"), and the engine checks the same rules on the pools it built (`kv_capacity`
    their tokens, `max_context` 0, `host_kv_mib` 1 where a host tier exists)."""
    out: list[TierProblem] = []

    def add(names: str, message: str, remedy: str) -> None:
        out.append(TierProblem(tuple(names.split()), message, remedy))

    window, retrieve, ring, host = v["kv_window"], v["kv_retrieve"], v["kv_ring"], v["host_kv_mib"]
    cap, ctx = v["kv_capacity"], v["max_context"]
    ringed = window > 0 and ring != "off"
    if isinstance(cap, int) and 0 < cap < ctx and window == 0:
        add("kv_capacity max_context", f"--kv-capacity {cap} is below --max-context {ctx}: a KV cache smaller than the "
            f"context needs ring mode", f"set --kv-window (e.g. {min(cap // 2, 16384)}) with --kv-retrieve and "
            f"--host-kv-mib, or raise --kv-capacity to at least {ctx} (or use auto), or lower --max-context to {cap}")
    if retrieve and window == 0:
        add("kv_retrieve kv_window", f"--kv-retrieve {retrieve} brings older pages back into a window, but "
            f"--kv-window is 0", "set --kv-window (e.g. 4096) or --kv-retrieve 0")
    if retrieve and window and ring == "off":
        add("kv_retrieve kv_ring", f"--kv-retrieve {retrieve} has nothing to bring back with --kv-ring off (the window "
            f"caps each conversation, nothing older is kept)", "use --kv-ring auto (with --host-kv-mib) or "
            "--kv-retrieve 0")
    if ring == "on" and window == 0:
        add("kv_ring kv_window", "--kv-ring on needs a window", "set --kv-window (e.g. 4096) or --kv-ring auto")
    if ringed and host == 0:
        add("kv_window host_kv_mib", f"--kv-window {window} keeps older pages in host memory, but --host-kv-mib is 0",
            "set --host-kv-mib (e.g. 4096), or --kv-ring off to cap each conversation at the window")
    if host and not ringed and not v["kv_reuse_hostbacked"]:
        why = "--kv-ring is off" if window else "--kv-window is 0"
        add("host_kv_mib " + ("kv_window" if not window else "kv_ring"), f"--host-kv-mib {host} is used only by ring "
            f"mode and by --kv-reuse-hostbacked, and {why}", "set --kv-window (with --kv-ring auto) or "
            "--kv-reuse-hostbacked, or --host-kv-mib 0")
    if v["kv_reuse_hostbacked"] and host == 0:
        add("kv_reuse_hostbacked host_kv_mib", "--kv-reuse-hostbacked keeps evicted prefix pages in host memory, but "
            "--host-kv-mib is 0", "set --host-kv-mib (e.g. 4096) or drop --kv-reuse-hostbacked")
    if v["kv_reuse_hostbacked"] and v["max_shared_prefixes"] == 0:
        add("kv_reuse_hostbacked max_shared_prefixes", "--kv-reuse-hostbacked extends prefix reuse, but "
            "--max-shared-prefixes is 0 (off)", "set --max-shared-prefixes (or auto) or drop --kv-reuse-hostbacked")
    if ringed and retrieve == 0 and not v["allow_lossy_window"]:
        add("kv_window kv_retrieve", f"--kv-window {window} with --kv-retrieve 0 never attends to context older than "
            f"the window again, so answers would silently miss it", f"set --kv-retrieve (e.g. {window}), or pass "
            f"--allow-lossy-window to accept that")
    if v["host_pageable"] and host == 0:
        add("host_pageable host_kv_mib", "--host-pageable applies to the host KV tier, but --host-kv-mib is 0",
            "set --host-kv-mib or drop --host-pageable")
    if window and v["spec"] == "mtp":
        add("spec kv_window", "--spec mtp does not run on windowed KV (its heads run over the target's page table)",
            "use --spec ngram or --spec draft, or --kv-window 0")
    if ringed and isinstance(cap, int):
        spec = WindowSpec.from_settings(v)
        need = spec.footprint * PAGE_SIZE
        if cap < need:
            add("kv_capacity kv_window", f"--kv-capacity {cap} is below what one windowed conversation holds on the "
                f"GPU ({need} tokens: {spec.footprint_text()})", f"raise --kv-capacity to {need} or lower "
                f"--kv-window / --kv-retrieve / --prefill-chunk")
    return out


def state_slots(max_concurrency: int, speculative: bool = False) -> int:
    """Recurrent-state slots a model with recurrent layers gets on its device (engine/memory/state.py): one per
    running sequence, and one more per sequence when speculating (the checkpoint a rejected draft rolls back to).
    Prefix snapshots live in host memory (`state_snapshots` of them)."""
    return max_concurrency * (2 if speculative else 1)


def pads(max_batch: int) -> bool:
    """Whether static decode batches (CUDA graphs: power-of-two sizes) of up to `max_batch` sequences (0: unknown)
    may have dummy rows: their recurrent state then steps in one more, scratch, slot."""
    return not 0 < max_batch <= 2


def state_snapshots(max_concurrency: int, prefix_reuse: bool) -> int:
    """Recurrent-state snapshots kept for prefix reuse: two for each sequence that runs at once, the deepest within
    its prompt and the deepest of all (engine/memory/state.py); none without reuse."""
    return 2 * max_concurrency if prefix_reuse else 0
