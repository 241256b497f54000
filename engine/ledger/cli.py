"""`ninfer-doctor --ledger`: options and the printed report."""
from __future__ import annotations

import argparse
import json
from typing import Any

from engine.errors import NInferError
from engine.config.table import SETTINGS
from engine.ledger.common import PAGE_SIZE, SYNTHETIC_NAMES, WEIGHT_BITS
from engine.memory.geometry import KVLayout, KV_DTYPES, KV_LAYOUTS, resolve_kv_dtype
from engine.ledger.shapes import LinearAttention, ModelShape
from engine.ledger.core import Ledger, LedgerLine, LedgerProblem, _KEYS, build_ledger, format_ledger


def _capacity(text: str) -> str | int:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number of tokens") from None
    if value < 64:
        raise argparse.ArgumentTypeError("must be at least 64 tokens, or auto")
    return value


def _choices(name: str) -> tuple[str, ...]:
    return next(s.choices for s in SETTINGS if s.name == name)


def add_ledger_arguments(parser: argparse.ArgumentParser) -> None:
    """``ninfer-doctor --ledger`` and its settings (defaults: the engine's; VRAM/RAM: what this machine has)."""
    g = parser.add_argument_group("memory ledger", "plan memory before loading anything (--ledger)")
    g.add_argument("--ledger", action="store_true",
                   help="print the memory ledger of a model and configuration, and whether it fits")
    g.add_argument("--model", metavar="PATH|NAME",
                   help=f"GGUF file, model folder, or a synthetic shape ({', '.join(SYNTHETIC_NAMES)}); "
                        "default: the embedded model")
    g.add_argument("--vram-mib", type=int, metavar="N", help="GPU memory to plan for (0: no GPU); default: this GPU's")
    g.add_argument("--ram-mib", type=int, metavar="N", help="host RAM to plan for; default: available RAM")
    g.add_argument("--weight-dtype", choices=_choices("weight_dtype"))
    g.add_argument("--kv-dtype", choices=KV_DTYPES, help="including the planning-only rk4v4-e8 / k4v4-e8")
    g.add_argument("--kv-capacity", type=_capacity, metavar="N|auto")
    for flag in ("kv-headroom-mib", "host-kv-mib", "max-context", "max-concurrency", "kv-window", "kv-retrieve",
                 "prefill-chunk", "draft-tokens"):
        g.add_argument(f"--{flag}", type=int, metavar="N")
    g.add_argument("--kv-ring", choices=_choices("kv_ring"))
    g.add_argument("--spec", choices=_choices("spec"))
    g.add_argument("--draft-model", metavar="PATH")
    g.add_argument("--gdn-state-fp16", action="store_true", default=None)
    g.add_argument("--kv-reuse-hostbacked", action="store_true", default=None,
                   help="evicted prefix pages keep a host copy and come back on a hit")


def wants_ledger(args: argparse.Namespace) -> bool:
    """--ledger, or any of its options (which mean nothing to the hardware report)."""
    names = ("ledger", "model", "vram_mib", "ram_mib", "kv_capacity", *_KEYS)
    return any(getattr(args, n, None) not in (None, False) for n in names)


def run_ledger(args: argparse.Namespace, probe: Any = None) -> int:
    """Prints the ledger (or JSON with --json); 0 when it fits, 1 when it does not or the model cannot be read."""
    vram, ram = args.vram_mib, args.ram_mib
    if vram is None or ram is None:
        if probe is None:
            from engine.hardware import probe
        report = probe()
        gpu = report.usable_gpu()
        if vram is None:
            vram = (gpu.vram_free_mib if gpu.vram_free_mib is not None else gpu.vram_total_mib) if gpu else 0
        if ram is None:
            ram = report.ram_available_mib
    try:
        shape = ModelShape.from_path(args.model).on_device(int(vram) > 0, args.weight_dtype or "auto")
        overrides = {k: getattr(args, k, None) for k in _KEYS}
        ledger = build_ledger(shape, None, vram_mib=int(vram), ram_mib=int(ram), **overrides)
    except NInferError as e:
        print(f"[ERROR] {e.problem}" + (f"\n        -> {e.remedy}" if e.remedy else ""))
        return 1
    if getattr(args, "json", False):
        print(json.dumps(ledger.as_dict(), indent=2))
    else:
        print(format_ledger(ledger))
    return 0 if ledger.fits else 1


__all__ = ["PAGE_SIZE", "KV_LAYOUTS", "KV_DTYPES", "WEIGHT_BITS", "KVLayout", "LinearAttention", "ModelShape",
           "LedgerLine", "LedgerProblem", "Ledger", "build_ledger", "format_ledger", "resolve_kv_dtype",
           "add_ledger_arguments", "run_ledger", "wants_ledger"]
