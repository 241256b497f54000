"""``ninfer-doctor``: what hardware NInfer sees, what it will run on, and what to fix.

Exit status 0 when nothing is wrong enough to stop the engine, 1 when a verdict is an error.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.hardware import HardwareReport, probe, summarise_arch_list
from engine.ledger import add_ledger_arguments, run_ledger, wants_ledger

_TAGS = {"ok": "[OK]", "warning": "[WARN]", "error": "[ERROR]"}
_LABEL = 10  # width of the left-hand labels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer-doctor",
        description="Check the GPU, PyTorch build, NVIDIA driver, RAM and CPU NInfer will run on.")
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    add_ledger_arguments(parser)  # --ledger: the memory ledger of a model and configuration (engine/ledger/)
    return parser


def _line(label: str, text: str) -> str:
    return f"{label:<{_LABEL}} {text}"


def format_report(report: HardwareReport) -> str:
    """The human-readable hardware report."""
    if report.cuda_version:
        cuda = f"{report.cuda_version}, compiled for {summarise_arch_list(report.arch_list)}"
    else:
        cuda = "none (this PyTorch is a CPU build)"
    lines = [
        "NInfer doctor: hardware report",
        "",
        _line("PyTorch", report.torch_version),
        _line("CUDA", cuda),
        _line("NVML", report.nvml),
    ]
    if not report.gpus:
        lines.append(_line("GPUs", "none found"))
    for gpu in report.gpus:
        major, minor = gpu.capability
        supported = "yes" if report.supports(gpu) else "no"
        free = "unknown" if gpu.vram_free_mib is None else f"{gpu.vram_free_mib} MiB"
        lines.append(_line(f"GPU {gpu.index}", f"{gpu.name}, {gpu.arch} (compute capability {major}.{minor}), "
                                               f"supported by this PyTorch: {supported}"))
        lines.append(_line("", f"VRAM {gpu.vram_total_mib} MiB total, {free} free"))
    lines += [
        _line("Host RAM", f"{report.ram_total_mib} MiB total, {report.ram_available_mib} MiB available"),
        _line("CPU", f"{report.cpu_name} ({report.cpu_count} logical CPUs)"),
        "",
    ]
    for verdict in report.verdicts:
        tag = _TAGS.get(verdict.level, f"[{verdict.level.upper()}]")
        lines.append(f"{tag:<8}{verdict.message}")
        if verdict.remedy:
            lines.append(f"{'':<8}-> {verdict.remedy}")
    usable = report.usable_gpu()
    where = f"{report.device} ({usable.name})" if usable else report.device
    lines += ["", f"The engine will use: {where}"]
    return "\n".join(lines)


def _hardware(args: argparse.Namespace) -> int:
    report = probe()
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
    return 1 if any(v.level == "error" for v in report.verdicts) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Other reports plug in here as their own flag and handler; the hardware report is the default.
    if wants_ledger(args):
        return run_ledger(args, probe)
    return _hardware(args)


if __name__ == "__main__":
    sys.exit(main())
