"""--fit for mixture-of-experts models: where the experts go when the GPU cannot hold the whole model.

As llama.cpp's --fit: keep everything on the GPU when it fits; otherwise move the routed experts of the first N MoE
layers to host memory (computed on the CPU, engine/model/moe.py), N as small as lets the ledger fit with its
headroom (--kv-headroom-mib, 1 GiB by default) and a context of at least FIT_MIN_CONTEXT tokens (or the model's own,
if shorter). With the KV dtype left to the engine (--kv-dtype auto), each N also tries FIT_KV_DTYPES after the
float KV: the 8-bit KV (near-lossless, half the bytes) wins where it fits with fewer experts moved or a longer
context, since a layer's experts on the host cost far more speed than 8-bit keys and values cost quality. The ledger
is the one the engine is sized with (engine/ledger/core.py), so the plan and the allocation read the same numbers. A
model that does not fit even with every expert on the host is refused with them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.ledger.core import Ledger, build_ledger, setting_value
from engine.ledger.shapes import ModelShape
from engine.memory.geometry import resolve_kv_dtype

FIT_MIN_CONTEXT = 4096
FIT_KV_DTYPES = ("k8v8",)  # tried after the float KV where --kv-dtype is auto, smallest loss first


@dataclass(frozen=True)
class Placement:
    host_layers: int | None  # MoE layers whose experts go to host memory; None: nothing fits
    context: int  # the context the plan leaves (0 when nothing fits)
    ledger: Ledger  # the ledger of the plan (of the last one tried when nothing fits)
    why: str  # for the load log and the launcher: what was chosen and why
    kv_dtype: str = "auto"  # the KV dtype the plan holds its context with (the setting, or --fit's choice)


def _fitting(shape: ModelShape, settings: Any, n: int, kv: str, vram_mib: int, ram_mib: int,
             min_context: int) -> tuple[Ledger, int]:
    """The ledger with the experts of n layers on the host and KV dtype `kv`, and the context it holds (0: it does
    not fit). A context left to the model (max_context 0) may shorten to what the KV memory reaches, down to
    min_context."""
    ledger = build_ledger(shape, settings, vram_mib=vram_mib, ram_mib=ram_mib, cpu_moe=False, n_cpu_moe=n,
                          kv_dtype=kv)
    if ledger.fits:
        return ledger, ledger.max_context
    asked = int(ledger.settings["max_context"])
    errors = {p.line for p in ledger.check() if p.level == "error"}
    if asked or not ledger.gpu_pages or not errors <= {"kv", "host_kv", "context"}:
        return ledger, 0
    reach = ledger.reach_tokens
    if reach < min_context:
        return ledger, 0
    ledger = build_ledger(shape, settings, vram_mib=vram_mib, ram_mib=ram_mib, cpu_moe=False, n_cpu_moe=n,
                          kv_dtype=kv, max_context=reach)
    return ledger, ledger.max_context if ledger.fits else 0


def fit_experts(shape: ModelShape, settings: Any = None, *, vram_mib: int, ram_mib: int) -> Placement:
    """The fewest MoE layers whose experts go to host memory for the model to fit, and the KV dtype (see the
    module)."""
    min_context = min(FIT_MIN_CONTEXT, shape.max_position)
    asked_kv = str(setting_value("kv_dtype", settings, {}))
    kvs = (asked_kv, *FIT_KV_DTYPES) if asked_kv == "auto" else (asked_kv,)
    ledger = None
    for n in range(shape.moe_layers + 1):
        fits = []
        for kv in kvs:
            ledger, context = _fitting(shape, settings, n, kv, vram_mib, ram_mib, min_context)
            if context:
                fits.append((context, -len(fits), kv, ledger))
        if fits:
            context, _, kv, ledger = max(fits)  # the longest context; the float KV where it holds as much
            return Placement(n, context, ledger, _why(shape, n, context, min_context, ledger, kv, kvs), kv)
    problems = "; ".join(p.message for p in ledger.check() if p.level == "error")
    return Placement(None, 0, ledger, f"it does not fit even with every expert in host memory and a "
                                      f"{min_context}-token context: {problems}", kvs[-1])


def _why(shape: ModelShape, n: int, context: int, min_context: int, ledger: Ledger, kv: str,
         kvs: tuple[str, ...]) -> str:
    gpu = ledger.total("gpu") / 2**30
    if n == 0:
        why = f"the whole model fits the GPU ({gpu:.2f} GiB with a {context}-token context)"
    else:
        host = ledger.line("host_experts").bytes / 2**30
        why = (f"the experts of {n} of {shape.moe_layers} MoE layers go to host memory ({host:.2f} GiB, computed "
               f"on the CPU): the fewest that leave the GPU {gpu:.2f} GiB with its headroom and a {context}-token "
               f"context (at least {min_context})")
    if kv != kvs[0]:
        why += (f"; the KV in {kv}: it holds a longer context, or needs fewer experts moved, than "
                f"{resolve_kv_dtype(kvs[0], True)}")
    return why
