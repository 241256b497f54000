"""The ledger itself: lines per device, KV sizing, and the checks that refuse what cannot fit."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from engine.errors import NInferError
from engine.config.engine_config import EngineConfig
from engine.memory.geometry import WindowSpec, pads, sequence_reach, state_slots, state_snapshots
from engine.ledger.common import (
    ACTIVATION_BYTES_PER_HIDDEN, CPU_KV_RAM_FRACTION, DEFAULT_DRAFT_TOKENS, DFLASH2_DRAFT_BYTES, GIB,
    HOST_RUNTIME_MIB, MIB, PAGE_SIZE, WEIGHT_BITS, _DEFAULTS, _ceil_div)
from engine.memory.geometry import KVLayout, KV_LAYOUTS, resolve_kv_dtype
from engine.ledger.shapes import ModelShape
from engine.ledger.vision import vision_lines
from engine.memory.dtypes import FLOAT_FORMATS, auto_float


@dataclass(frozen=True)
class LedgerLine:
    key: str  # stable id: weights, host_experts, draft, draft_kv, headroom, activations, state, kv, runtime, host_kv
    name: str
    bytes: int
    device: str  # "gpu" or "host"
    note: str = ""
    estimate: bool = False
    reserved: bool = False  # kept free, not allocated (the headroom)


@dataclass(frozen=True)
class LedgerProblem:
    level: str  # "error" or "warning"
    line: str  # the key of the ledger line at fault
    message: str
    remedy: str = ""

    def __str__(self) -> str:
        return f"{self.message} -> {self.remedy}" if self.remedy else self.message


@dataclass
class Ledger:
    shape: ModelShape
    lines: list[LedgerLine]
    budgets: dict[str, int]  # device -> bytes (gpu absent when there is no GPU)
    weight_dtype: str
    kv_dtype: str
    page_size: int
    page_bytes: int
    gpu_pages: int  # pages of the KV pool on the KV device (the GPU, or host RAM without a GPU)
    kv_auto: bool
    kv_pages_fit: int  # pages that would fit in the memory left (auto sizing)
    kv_pages_wanted: int  # pages all sequences need resident (max_context or window) x concurrency
    host_pages: int
    host_pages_needed: int  # host pages one sequence at max_context needs
    host_kv_max_bytes: int  # the host KV pool RAM would allow after the other host lines
    max_context: int
    max_concurrency: int
    kv_window: int
    hostbacked: bool
    reach_gpu_tokens: int  # tokens one sequence can hold in the KV pool (the window, when there is one)
    reach_tiered_tokens: int | None  # the same with the host tier (None without one)
    settings: dict[str, Any]
    problems: list[LedgerProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    # -- sums
    def device_lines(self, device: str) -> list[LedgerLine]:
        return [line for line in self.lines if line.device == device]

    def total(self, device: str) -> int:
        return sum(line.bytes for line in self.device_lines(device))

    def allocated(self, device: str) -> int:
        return sum(line.bytes for line in self.device_lines(device) if not line.reserved)

    def free(self, device: str) -> int:
        """What a monitor would show free: the budget minus the allocated lines (the headroom counts as free)."""
        return self.budgets.get(device, 0) - self.allocated(device)

    def spare(self, device: str) -> int:
        """The budget minus every line, headroom included (negative: it does not fit)."""
        return self.budgets.get(device, 0) - self.total(device)

    def line(self, key: str) -> LedgerLine | None:
        return next((line for line in self.lines if line.key == key), None)

    @property
    def kv_device(self) -> str:
        return "gpu" if "gpu" in self.budgets else "host"

    @property
    def kv_capacity_tokens(self) -> int:
        return self.gpu_pages * self.page_size

    @property
    def reach_tokens(self) -> int:
        return self.reach_tiered_tokens if self.reach_tiered_tokens is not None else self.reach_gpu_tokens

    @property
    def host_kv_needed_bytes(self) -> int:
        return self.host_pages_needed * self.page_bytes

    def check(self) -> list[LedgerProblem]:
        """Every problem, errors first; an empty list (or warnings only) means the configuration fits."""
        return sorted(self.problems, key=lambda p: p.level != "error")

    @property
    def fits(self) -> bool:
        return not any(p.level == "error" for p in self.problems)

    def raise_if_refused(self) -> None:
        """For engine.build: raise the first error as an NInferError (problem, remedy) before anything loads."""
        errors = [p for p in self.problems if p.level == "error"]
        if errors:
            raise NInferError(errors[0].message, errors[0].remedy)

    def as_dict(self) -> dict:
        devices = {}
        for device, budget in self.budgets.items():
            devices[device] = {"budget": budget, "total": self.total(device), "allocated": self.allocated(device),
                               "free": self.free(device), "spare": self.spare(device),
                               "lines": [asdict(line) for line in self.device_lines(device)]}
        shape = asdict(self.shape)
        shape["weight_bytes_by_dtype"] = dict(self.shape.weight_bytes_by_dtype)
        return {
            "model": self.shape.name, "shape": shape, "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype,
            "devices": devices,
            "kv": {"device": self.kv_device, "page_size": self.page_size, "page_bytes": self.page_bytes,
                   "bytes_per_token": self.page_bytes // self.page_size, "pages": self.gpu_pages,
                   "capacity_tokens": self.kv_capacity_tokens, "auto": self.kv_auto, "pages_fit": self.kv_pages_fit,
                   "pages_wanted": self.kv_pages_wanted, "host_pages": self.host_pages,
                   "host_pages_needed": self.host_pages_needed, "host_kv_needed_bytes": self.host_kv_needed_bytes,
                   "host_kv_max_bytes": self.host_kv_max_bytes, "max_context": self.max_context,
                   "max_concurrency": self.max_concurrency, "window": self.kv_window, "hostbacked": self.hostbacked,
                   "reach_gpu_tokens": self.reach_gpu_tokens, "reach_tiered_tokens": self.reach_tiered_tokens},
            "settings": dict(self.settings),
            "problems": [asdict(p) for p in self.check()], "notes": list(self.notes), "fits": self.fits,
        }


def setting_value(name: str, settings: Any, overrides: Mapping[str, Any]) -> Any:
    """One setting of a ledger: the override, else the settings' value, else the default."""
    if name in overrides and overrides[name] is not None:
        return overrides[name]
    if isinstance(settings, Mapping):
        if settings.get(name) is not None:
            return settings[name]
    elif settings is not None and getattr(settings, name, None) is not None:
        return getattr(settings, name)
    return _DEFAULTS.get(name)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


_KEYS = tuple(f.name for f in fields(EngineConfig))  # the settings a ledger may be given (it reads its own)


def build_ledger(shape: ModelShape, settings: Any = None, *, vram_mib: int, ram_mib: int,
                 include_weights: bool = True, **overrides: Any) -> Ledger:
    """The ledger of ``shape`` under ``settings`` (an engine Settings, a mapping of setting names, or None for the
    defaults; keyword ``overrides`` win) on ``vram_mib`` of GPU memory (0: no GPU, everything in RAM) and ``ram_mib``
    of host RAM. ``include_weights=False``: the weights and the runtime are already loaded, and ``vram_mib`` /
    ``ram_mib`` are the free memory measured after loading them (what engine.build sizes the KV pools with)."""
    unknown = set(overrides) - set(_KEYS)
    if unknown:
        raise TypeError(f"build_ledger: unknown setting(s) {', '.join(sorted(unknown))}")
    s = {k: setting_value(k, settings, overrides) for k in _KEYS}
    on_gpu = vram_mib > 0
    kv_device = "gpu" if on_gpu else "host"
    kv_dtype = resolve_kv_dtype(str(s["kv_dtype"]), on_gpu)
    wdtype = str(s["weight_dtype"])
    if wdtype != "auto" and wdtype not in WEIGHT_BITS:
        raise ValueError(f"unknown weight dtype {wdtype!r}; one of auto, {', '.join(WEIGHT_BITS)}")
    shape = shape.on_device(on_gpu, wdtype)  # the conv window in the dtype the engine keeps it in there
    layout = KV_LAYOUTS[kv_dtype]
    page_bytes = shape.kv_bytes_per_token(kv_dtype) * PAGE_SIZE
    conc = max(int(s["max_concurrency"]), 1)
    chunk = int(s["prefill_chunk"])
    spec = str(s["spec"])
    problems: list[LedgerProblem] = []
    notes: list[str] = []
    lines: list[LedgerLine] = []

    def add(key, name, nbytes, device=kv_device, note="", estimate=False, reserved=False):
        if nbytes:
            lines.append(LedgerLine(key, name, int(nbytes), device, note, estimate, reserved))

    # -- context
    context = int(s["max_context"]) or shape.max_position
    if int(s["max_context"]) > shape.max_position:
        problems.append(LedgerProblem(
            "error", "context", f"--max-context {s['max_context']} is beyond this model's trained context of "
                                f"{shape.max_position} tokens.",
            f"Use --max-context {shape.max_position} or less (0 = the model's)."))
    ctx_pages = _ceil_div(context, PAGE_SIZE)

    # -- every line but the KV pool
    weights = shape.weight_bytes(wdtype) if include_weights else 0
    what = f"{wdtype}, {shape.params / 1e9:.2f} B params" if wdtype != "auto" else \
        f"as stored: {shape.stored_format or 'bf16'}"
    host_moe = (shape.moe_layers if s["cpu_moe"] else min(int(s["n_cpu_moe"]), shape.moe_layers)) if on_gpu else 0
    moved = shape.expert_bytes(wdtype, host_moe) if include_weights else 0
    add("weights", f"weights ({what}{', less the host experts' if moved else ''})", weights - moved,
        note="" if include_weights else "already loaded")
    add("host_experts", f"experts of {host_moe} of {shape.moe_layers} MoE layers (host memory, computed on the "
                        f"CPU: --{'cpu-moe' if s['cpu_moe'] else 'n-cpu-moe'})", moved, device="host")
    draft_bytes, draft_page_bytes, draft_name = 0, 0, ""
    if spec == "mtp":
        draft_bytes = round(shape.mtp_params() * shape.weight_bytes(wdtype) / max(shape.params, 1))
        draft_page_bytes = layout.bytes_per_token(1, shape.kv_heads, shape.head_dim) * PAGE_SIZE
        draft_name = "MTP head, 1 layer"
        if not shape.mtp_layers and shape.source != "config":
            notes.append("This model ships no MTP layer: --spec mtp needs one; the MTP line is what one would cost.")
    elif spec == "dflash2":
        draft_bytes, draft_name = DFLASH2_DRAFT_BYTES, "DFlash2 drafter, ~2 GB"
    elif spec == "draft":
        if s["draft_model"]:
            draft = ModelShape.from_path(s["draft_model"])
            draft_bytes = draft.weight_bytes(wdtype)
            draft_page_bytes = draft.kv_bytes_per_token(kv_dtype) * PAGE_SIZE
            draft_name = f"draft model {draft.name}"
            # a hybrid drafter: a state slot and a checkpoint per sequence (engine/speculative/draft.py)
            draft_state = draft.on_device(on_gpu, wdtype).state_bytes() * 2 * int(s["max_concurrency"])
            if draft_state:
                draft_bytes += draft_state
                draft_name += f", its recurrent state x{2 * int(s['max_concurrency'])} slots"
        else:
            problems.append(LedgerProblem("error", "draft", "--spec draft needs a draft model.",
                                          "Set --draft-model PATH, or use --spec mtp / ngram / none."))
    add("draft", f"draft weights ({draft_name})", draft_bytes, estimate=spec in ("mtp", "dflash2"))
    headroom = int(s["kv_headroom_mib"]) * MIB
    add("headroom", "runtime headroom (--kv-headroom-mib, kept free)", headroom, reserved=True)
    draft_tokens = int(s["draft_tokens"]) or DEFAULT_DRAFT_TOKENS.get(spec, 0)
    act = chunk * shape.hidden * ACTIVATION_BYTES_PER_HIDDEN * (1 if on_gpu else 2) \
        + shape.vocab * 4 * conc * (1 + draft_tokens)
    add("activations", f"activations/workspace (prefill chunk {chunk})", act, estimate=True)
    if shape.vision is not None:
        act_bytes = (FLOAT_FORMATS.get(wdtype) or auto_float(on_gpu)).bits // 8  # the tower runs dense in it
        vision_lines(add, shape.vision, int(s["max_image_pixels"]), act_bytes, include_weights, notes)
    speculative = spec not in ("none", "")
    snapshots = state_snapshots(conc, s["max_shared_prefixes"] != 0)
    # on a GPU decode steps run as static batches (engine/model/graphs.py, CUDA graphs or not): of more than 2
    # sequences they may pad with dummy rows, whose state steps in one scratch slot
    graphs = on_gpu and pads(conc)
    slots = state_slots(conc, speculative) + graphs
    one_state = shape.state_bytes(bool(s["gdn_state_fp16"]))
    if one_state:
        fmt = "fp16" if s["gdn_state_fp16"] else "fp32"
        extra = [f"{conc} draft checkpoints" if speculative else "", "1 scratch (static decode batches)" if graphs
                 else ""]
        add("state", f"recurrent state ({shape.linear_layers} linear layers, {fmt}, x{slots} slots: {conc} seq"
                     f"{''.join(', ' + e for e in extra if e)})", one_state * slots)
        add("state_snapshots", f"recurrent-state prefix snapshots (up to {snapshots}, host memory)",
            one_state * snapshots, device="host")
    if include_weights:
        add("runtime", "host runtime (Python, PyTorch, server)", HOST_RUNTIME_MIB["gpu" if on_gpu else "cpu"] * MIB,
            device="host", estimate=True)
    if on_gpu:
        budgets = {"gpu": vram_mib * MIB, "host": ram_mib * MIB}
    else:
        budgets = {"host": ram_mib * MIB}

    # -- the KV pool on the KV device
    window, ring = int(s["kv_window"]), str(s["kv_ring"])
    ringed = window > 0 and ring != "off"  # sequences may run windowed: each takes its footprint (plan_tiers)
    capped = window > 0 and ring == "off"  # the window caps every sequence, nothing goes to the host
    resident = ctx_pages
    if ringed:  # a windowed sequence's GPU pages: engine.memory.geometry.WindowSpec.footprint
        resident = WindowSpec.from_settings(dict(kv_window=window, kv_retrieve=int(s["kv_retrieve"]),
                                                   prefill_chunk=chunk)).footprint
    elif capped:
        resident = min(_ceil_div(window, PAGE_SIZE), ctx_pages)
    wanted = resident * conc
    other = sum(line.bytes for line in lines if line.device == kv_device)
    room = budgets[kv_device] - other
    if not on_gpu:
        room = min(room, int(ram_mib * MIB * CPU_KV_RAM_FRACTION))
    fit = max(room, 0) // (page_bytes + draft_page_bytes)
    auto = s["kv_capacity"] == "auto"
    pages = min(wanted, fit) if auto else _ceil_div(int(s["kv_capacity"]), PAGE_SIZE)
    how = ("auto, all wanted" if fit >= wanted else "auto, what fits") if auto else "--kv-capacity"
    add("kv", f"KV pages ({pages:,} x {page_bytes / MIB:.3f} MiB {kv_dtype}, {how})", pages * page_bytes)
    add("draft_kv", f"draft KV ({pages:,} pages x {draft_page_bytes / MIB:.3f} MiB)", pages * draft_page_bytes)

    # -- the host tier
    # without a GPU the host tier is a second pool in RAM beside the device pool (the engine runs the same code)
    host_kv = int(s["host_kv_mib"]) * MIB
    host_pages = host_kv // page_bytes
    add("host_kv", f"host KV pages ({host_pages:,} x {page_bytes / MIB:.3f} MiB)", host_pages * page_bytes,
        device="host")
    host_other = sum(line.bytes for line in lines if line.device == "host" and line.key != "host_kv")
    host_kv_max = max(budgets["host"] - host_other, 0)
    hostbacked = bool(s["kv_reuse_hostbacked"])
    reach_gpu, reach_tiered = sequence_reach(pages, host_pages, window, ring)
    host_needed = ctx_pages if ringed else 0

    ledger = Ledger(shape, lines, budgets, wdtype, kv_dtype, PAGE_SIZE, page_bytes, pages, auto, fit, wanted,
                    host_pages, host_needed, host_kv_max, context, conc, window if ringed or capped else 0, hostbacked,
                    reach_gpu, reach_tiered, s, problems, notes)
    _check(ledger, layout)
    return ledger


def _sum_text(lines: list[LedgerLine]) -> str:
    return " + ".join(f"{_short(line)} {_gib(line.bytes)}" for line in lines)


def _short(line: LedgerLine) -> str:
    return {"weights": "weights", "draft": "draft", "draft_kv": "draft KV", "headroom": "headroom",
            "activations": "activations", "state": "state", "kv": "KV", "runtime": "runtime",
            "host_kv": "host KV", "host_experts": "host experts", "vision": "vision tower",
            "vision_activations": "vision activations", "encoder_cache": "encoder cache"}.get(line.key, line.key)


_REMEDY = {
    "draft": "Use --spec mtp (a one-layer head) or --spec ngram (no weights), or --spec none.",
    "headroom": "Lower --kv-headroom-mib if nothing else needs that memory.",
    "activations": "Lower --prefill-chunk.",
    "vision_activations": "Lower --max-image-pixels (bigger images are scaled down to fit).",
    "state": "Use --gdn-state-fp16 or a lower --max-concurrency.",
    "draft_kv": "Use a smaller draft model or --spec mtp / ngram.",
}


def _experts_remedy(ledger: Ledger, excess: int) -> str:
    """For a MoE model whose weights overflow the GPU: the --n-cpu-moe that moves at least `excess` bytes of experts
    to host memory, where one does ("" otherwise)."""
    shape, s = ledger.shape, ledger.settings
    if not shape.moe_layers or ledger.kv_device != "gpu" or s["cpu_moe"]:
        return ""
    wdtype, now = str(s["weight_dtype"]), min(int(s["n_cpu_moe"]), shape.moe_layers)
    moved = shape.expert_bytes(wdtype, now)
    for n in range(now + 1, shape.moe_layers + 1):
        if shape.expert_bytes(wdtype, n) - moved >= excess:
            return (f"Use --n-cpu-moe {n} (the experts of {n} of {shape.moe_layers} MoE layers in host memory, "
                    f"computed on the CPU) or --fit; or: ")
    return ""


def _check(ledger: Ledger, layout: KVLayout) -> None:
    """Adds the ledger's problems: an overflowing device (naming the line at fault) and context beyond reach."""
    problems, shape = ledger.problems, ledger.shape
    kv_device = ledger.kv_device
    budget = ledger.budgets[kv_device]
    where = "VRAM" if kv_device == "gpu" else "RAM"
    lines = ledger.device_lines(kv_device)
    total = ledger.total(kv_device)
    if layout.planning_only:
        ledger.notes.append(f"KV dtype {layout.name} is a planning-only layout: the engine cannot run it.")
    if total > budget or ledger.gpu_pages == 0:
        verb = ">" if total > budget else "of"
        head = f"{_sum_text(lines)} = {_gib(total)} {verb} {_gib(budget)} {where}"
        weights, draft = ledger.line("weights"), ledger.line("draft")
        headroom = ledger.line("headroom")
        after_headroom = budget - (headroom.bytes if headroom else 0)
        kv_bytes = sum(ln.bytes for ln in lines if ln.key in ("kv", "draft_kv"))
        others = total - kv_bytes
        if weights and weights.bytes > after_headroom and headroom and weights.bytes < headroom.bytes:
            problems.append(LedgerProblem(
                "error", "headroom", f"{head}: the headroom line ({_gib(headroom.bytes)}) leaves "
                                     f"{_gib(after_headroom)}, less than the weights line ({_gib(weights.bytes)}).",
                _REMEDY["headroom"]))
        elif weights and weights.bytes > after_headroom:
            alts = ", ".join(f"{d} {_gib(shape.weight_bytes(d))}" for d in ("int4", "ternary")
                             if shape.weight_bytes(d) < weights.bytes)
            problems.append(LedgerProblem(
                "error", "weights", f"{head}: the weights line alone ({_gib(weights.bytes)}) exceeds the "
                                    f"{_gib(after_headroom)} left after the headroom.",
                _experts_remedy(ledger, weights.bytes - after_headroom) +
                (f"Use a lower-bit --weight-dtype ({alts} for this model) or a smaller model" if alts else
                 "Use a smaller model (or a GPU with more memory)")
                + (", or lower --kv-headroom-mib." if weights.bytes <= budget else ".")))
        elif others > budget or (ledger.kv_auto and ledger.gpu_pages == 0):
            if draft and others - draft.bytes + (0 if ledger.kv_auto else kv_bytes) <= budget:
                culprit, why = draft, "does not fit beside the weights; without it the rest fits"
            else:
                culprit = max((ln for ln in lines if ln.key in _REMEDY), key=lambda ln: ln.bytes, default=weights)
                why = "is the largest line after the weights" if culprit is not weights else "leaves too little"
            where_kv = "" if others > budget else " no room is left for one KV page:"
            problems.append(LedgerProblem(
                "error", culprit.key, f"{head}:{where_kv} the {_short(culprit)} line ({_gib(culprit.bytes)}) {why}.",
                _REMEDY.get(culprit.key, "Use --weight-dtype ternary/int4 or a smaller model.")))
        else:  # everything but an explicit KV pool fits
            room = max(budget - others, 0)
            most = room // (ledger.page_bytes + _draft_page_bytes(ledger)) * ledger.page_size
            problems.append(LedgerProblem(
                "error", "kv", f"{head}: the KV pages line ({ledger.gpu_pages:,} pages, {_gib(kv_bytes)}, from "
                               f"--kv-capacity) does not fit in the {_gib(room)} left.",
                f"Use --kv-capacity auto or at most {most:,} tokens, or a smaller --kv-dtype (k8v4, rk4v4)."))
    host_total, host_budget = ledger.total("host"), ledger.budgets["host"]
    if kv_device == "gpu" and host_total > host_budget:
        host_lines = ledger.device_lines("host")
        culprit = ledger.line("host_kv") or max(host_lines, key=lambda ln: ln.bytes)
        problems.append(LedgerProblem(
            "error", culprit.key, f"{_sum_text(host_lines)} = {_gib(host_total)} > {_gib(host_budget)} RAM: the "
                                  f"{_short(culprit)} line overflows host memory.",
            f"Lower --host-kv-mib to at most {ledger.host_kv_max_bytes // MIB:,} (what RAM allows after the other "
            f"lines)."))
    # -- context reach
    ctx, reach = ledger.max_context, ledger.reach_tokens
    capped = ledger.kv_window and ledger.settings.get("kv_ring") == "off"
    if capped and ledger.fits and reach < ctx:
        ledger.notes.append(f"--kv-ring off caps each conversation at {reach:,} tokens (the window); longer ones are "
                            f"refused with context_length_exceeded.")
    elif ledger.fits and ledger.gpu_pages and reach < ctx:
        if ledger.reach_tiered_tokens is None:
            problems.append(LedgerProblem(
                "error", "kv", f"--max-context {ctx:,} does not fit: the KV pages line holds {reach:,} tokens "
                               f"({ledger.gpu_pages:,} pages" + (f", window {ledger.kv_window:,}" if ledger.kv_window
                                                                 else "") + ").",
                f"Lower --max-context to {reach:,}, use a smaller --kv-dtype (k8v4, rk4v4), or run ring mode: "
                f"--kv-window with --kv-retrieve and --host-kv-mib (older pages in host RAM)."))
        else:
            need_mib = _ceil_div(ledger.host_kv_needed_bytes, MIB)
            raise_it = f"raise --host-kv-mib to {need_mib:,}" if need_mib * MIB <= ledger.host_kv_max_bytes else \
                f"add RAM (it allows at most {ledger.host_kv_max_bytes // MIB:,} MiB of host KV)"
            problems.append(LedgerProblem(
                "error", "host_kv", f"--max-context {ctx:,} is beyond reach: with the host KV pages line "
                                    f"({ledger.host_pages:,} pages) a sequence reaches {reach:,} tokens; {ctx:,} "
                                    f"tokens need {ledger.host_pages_needed:,} host pages ({need_mib:,} MiB).",
                f"Lower --max-context to {reach:,}, or {raise_it}."))
    if ledger.host_pages and ledger.reach_tiered_tokens is None:
        ledger.notes.append("No sequence runs windowed (no --kv-window, --kv-ring off, or a window as long as the "
                            "context): the host KV pool holds " + ("only evicted prefix pages (--kv-reuse-hostbacked)."
                                                                   if ledger.hostbacked else "nothing."))
    full = _ceil_div(ctx, ledger.page_size)
    if ledger.fits and not ledger.kv_window and ledger.reach_tiered_tokens is None and \
            full <= ledger.gpu_pages < full * ledger.max_concurrency:
        ledger.notes.append(f"The KV pool holds {ledger.gpu_pages // full} full-length sequence(s) of {ctx:,} tokens "
                            f"at once; --max-concurrency {ledger.max_concurrency} sequences share it.")


def _draft_page_bytes(ledger: Ledger) -> int:
    line = ledger.line("draft_kv")
    return line.bytes // ledger.gpu_pages if line and ledger.gpu_pages else 0


# ---------------------------------------------------------------- output

def _row(name: str, nbytes: int, width: int, mark: str = "") -> str:
    return f"  {name:<{width}} {nbytes / MIB:>12,.1f} {nbytes / GIB:>8.2f}{mark}"


def format_ledger(ledger: Ledger) -> str:
    """The ledger as a statement: one block per device, lines in MiB and GiB, totals against the budget."""
    shape = ledger.shape
    bpt = ledger.page_bytes // ledger.page_size
    kinds = f"{shape.full_attention_layers} full attention ({shape.kv_heads} KV heads x {shape.head_dim})"
    if shape.linear_layers:
        kinds += f", {shape.linear_layers} linear attention"
    out = [f"NInfer memory ledger: {shape.name} [{shape.source}], {shape.layers} layers: {kinds}",
           f"KV {ledger.kv_dtype}: {bpt:,} B a token, {ledger.page_bytes / MIB:.4f} MiB a "
           f"{ledger.page_size}-token page",
           ""]
    width = max([len(line.name) for line in ledger.lines] + [50]) + 2
    for device, budget in ledger.budgets.items():
        title = "GPU (VRAM)" if device == "gpu" else "Host (RAM)"
        out.append(f"{title:<{width + 2}} {'MiB':>12} {'GiB':>8}")
        out += [_row(line.name, line.bytes, width, " *" if line.estimate else "")
                for line in ledger.device_lines(device)]
        out.append("  " + "-" * (width + 22))
        out.append(_row("total", ledger.total(device), width))
        out.append(_row("budget", budget, width))
        spare = ledger.spare(device)
        out.append(_row("left after every line" if spare >= 0 else "OVER BUDGET BY", abs(spare), width))
        headroom = ledger.line("headroom")
        if headroom and headroom.device == device:
            out.append(_row("free (budget - allocated; headroom counts as free)", ledger.free(device), width))
        out.append("")
    where = "GPU" if ledger.kv_device == "gpu" else "RAM"
    fit_txt = f", room for {ledger.kv_pages_fit:,}" if ledger.kv_auto else ""
    out.append(f"KV pool ({where}): {ledger.gpu_pages:,} pages = {ledger.kv_capacity_tokens:,} tokens "
               f"({'auto' if ledger.kv_auto else 'explicit'}: wanted {ledger.kv_pages_wanted:,}{fit_txt}), "
               f"shared by up to {ledger.max_concurrency} sequence(s)")
    if ledger.kv_window:
        out.append(f"Window: the last {ledger.kv_window:,} tokens of each sequence stay on the GPU")
    tier = ""
    if ledger.reach_tiered_tokens is not None:
        how = "every full page is written through to the host"
        tier = f"; with the host tier {ledger.reach_tiered_tokens:,} ({how})"
    out.append(f"Context reach of one sequence: {ledger.reach_gpu_tokens:,} tokens on the {where} alone{tier}; "
               f"--max-context {ledger.max_context:,}")
    if "gpu" in ledger.budgets:
        out.append(f"Host KV: {ledger.host_pages:,} pages; one --max-context sequence needs "
                   f"{ledger.host_pages_needed:,} "
                   f"({_mib(ledger.host_kv_needed_bytes)}); RAM would allow up to {_mib(ledger.host_kv_max_bytes)}")
    out.append("* an estimate (see engine/ledger/)")
    out += [f"Note: {note}" for note in ledger.notes]
    out.append("")
    for p in ledger.check():
        out.append(f"{'[ERROR]' if p.level == 'error' else '[WARN]':<8}{p.message}")
        if p.remedy:
            out.append(f"{'':<8}-> {p.remedy}")
    out.append("Verdict: fits." if ledger.fits else "Verdict: does not fit; refused before loading anything.")
    return "\n".join(out)
