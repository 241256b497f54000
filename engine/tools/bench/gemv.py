"""``ninfer-bench --gemv``: the C++ low-bit GEMVs (kernels/cpu_native.py) at sizes far beyond the last-level cache,
in GB/s against the machine's stream read bandwidth (machine.measure_read_bandwidth).

Each format's weight is made once with random codes and scales (the speed does not depend on their values) and
cloned until the copies hold at least twice the last-level cache; a pass calls the GEMV on every copy in turn, so
each call reads its weight from memory, not from a cache. Where the library has more than one code path for the
GEMV (`cpu_native.gemv_paths()`: the AVX2 one and, on a CPU with AVX-512 VNNI, the 512-bit one) and two splits of
the rows between the threads (`cpu_native.GEMV_SPLITS`), every variant's passes alternate (A, B, A, B, ...) so that a machine whose speed drifts moves them alike; the stream read is
measured before and after the passes. A "hot" pass calls one copy repeatedly: the same kernel reading from the
caches, which tells a kernel bound by its arithmetic from one bound by memory.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch

from engine.tools.bench.machine import MIB, LoadMeter, describe_stream, last_level_cache, measure_read_bandwidth
from kernels import cpu_native
from kernels.quant import QuantizedWeight

# name -> (format, scale dtype, mins, the op that reads it): GGUF's Q4_0 / Q4_1 / Q8_0 as the engine keeps them, and
# the output layer's int8 codes with float32 scales (q8_linear, twice-rounded activations)
FORMATS = {
    "q4_0": ("int4_sym", torch.float16, False, "lowbit"),
    "q4_1": ("int4_asym", torch.float16, True, "lowbit"),
    "q8_0": ("int8", torch.float16, False, "lowbit"),
    "q8_out": ("int8", torch.float32, False, "q8"),
}
DEFAULT_SHAPES = "14336x4096,4096x14336"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'14336x4096,4096x14336' -> [(out, in), ...]; in_features a multiple of 32."""
    shapes = []
    for part in text.split(","):
        try:
            out_f, in_f = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--gemv-shapes: {part!r} is not OUTxIN (e.g. 14336x4096)") from None
        if out_f < 1 or in_f < 32 or in_f % 32 or in_f > cpu_native.LOWBIT_MAX_IN:
            raise ValueError(f"--gemv-shapes: {part!r}: need out >= 1 and in a multiple of 32 up to "
                             f"{cpu_native.LOWBIT_MAX_IN}")
        shapes.append((out_f, in_f))
    return shapes


def make_weight(name: str, out_f: int, in_f: int, seed: int = 0) -> QuantizedWeight:
    """A random weight of format `name` (FORMATS), group 32, as the engine keeps a GGUF file's."""
    fmt, scale_dtype, mins, _ = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    groups = in_f // 32
    if fmt == "int8":
        codes = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=g)
    else:
        codes = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(out_f, groups, generator=g) * 1e-2 + 1e-3).to(scale_dtype)
    m = (torch.rand(out_f, groups, generator=g) * -1e-2).to(scale_dtype) if mins else None
    return QuantizedWeight(fmt, codes, scales, m, 32, (out_f, in_f))


def weight_bytes(qw: QuantizedWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (qw.qweight, qw.scales, qw.mins) if t is not None)


def gemv_fn(name: str):
    return cpu_native.q8_linear if FORMATS[name][3] == "q8" else cpu_native.lowbit_linear


def _pass(fn, x, weights) -> float:
    t0 = time.perf_counter()
    for qw in weights:
        fn(x, qw)
    return time.perf_counter() - t0


def bench_format(name: str, shape: tuple[int, int], rows: int, repeat: int, llc: int | None) -> list[dict]:
    """One format at one shape: per code path, the median pass over copies > 2 x the LLC, and the hot pass."""
    qw = make_weight(name, *shape)
    per = weight_bytes(qw)
    copies = max(1, math.ceil(2 * (llc or 64 * MIB) / per))
    weights = [qw] + [QuantizedWeight(qw.format, qw.qweight.clone(), qw.scales.clone(),
                                      None if qw.mins is None else qw.mins.clone(), 32, qw.shape)
                      for _ in range(copies - 1)]
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    fn = gemv_fn(name)
    variants = [(p, split) for p in cpu_native.gemv_paths() for split in cpu_native.GEMV_SPLITS]
    cold = {v: [] for v in variants}
    hot = {v: [] for v in variants}
    for i in range(repeat + 1):
        for v in variants:
            with cpu_native.gemv_path(v[0]), cpu_native.gemv_split(v[1]):
                seconds = _pass(fn, x, weights)
                hot_s = _pass(fn, x, [qw] * len(weights))
            if i:  # pass 0 of each variant is its warm-up
                cold[v].append(seconds / len(weights))
                hot[v].append(hot_s / len(weights))
    return [dict(format=name, shape=f"{shape[0]}x{shape[1]}", rows=rows, path=f"{v[0]}, {v[1]}", bytes=per,
                 copies=copies, seconds=statistics.median(cold[v]), gbps=per / statistics.median(cold[v]) / 1e9,
                 best_gbps=per / min(cold[v]) / 1e9, hot_gbps=per / statistics.median(hot[v]) / 1e9)
            for v in variants]


def run(formats: list[str], shapes: list[tuple[int, int]], rows: int, repeat: int) -> dict:
    """Every format at every shape, the stream read before and after; returns the results and the table."""
    why = cpu_native.ready()
    if why is not None:
        raise RuntimeError(f"the C++ kernels are not available ({why}); install a C++ compiler and ninja")
    device = torch.device("cpu")
    llc = last_level_cache()
    before = measure_read_bandwidth(device)
    results = [r for name in formats for shape in shapes for r in bench_format(name, shape, rows, repeat, llc)]
    after = measure_read_bandwidth(device)
    stream = statistics.median(before["passes"] + after["passes"])
    for r in results:
        r["of_stream"] = r["gbps"] / stream
    return dict(stream_gbps=stream, stream_before=before, stream_after=after, results=results,
                table=format_gemv_table(results, stream, before, after))


def format_gemv_table(results: list[dict], stream: float, before: dict, after: dict) -> str:
    lines = [f"stream read bandwidth: {stream:.2f} GB/s (median of the passes before and after; before: "
             f"{describe_stream(before)}; after: {after['gbps']:.2f} GB/s)", "",
             "| format | out x in | rows | path, split | MB a GEMV | copies | ms a GEMV | GB/s | of stream | best GB/s | "
             "hot GB/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['format']} | {r['shape']} | {r['rows']} | {r['path']} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['copies']} | {r['seconds'] * 1e3:.3f} | {r['gbps']:.2f} | {r['of_stream']:.2f} | "
                     f"{r['best_gbps']:.2f} | {r['hot_gbps']:.2f} |")
    lines.append("")
    lines.append("GB/s: the weight's bytes (codes, scales, mins) / the median time a GEMV took over copies holding "
                 "2x the last-level cache (best: the fastest pass); hot: one copy again and again (from the caches). "
                 "split: the threads take one contiguous share of the rows each (static) or chunks in turn (dynamic).")
    return "\n".join(lines)


def run_from_args(args, command: str) -> int:
    """`ninfer-bench --gemv`: --gemv-formats, --gemv-shapes, --gemv-rows, --repeat, --threads, --json."""
    formats = [f.strip() for f in args.gemv_formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    try:
        if unknown or not formats:
            raise ValueError(f"--gemv-formats: {', '.join(unknown) or 'none given'}: choose from {', '.join(FORMATS)}")
        if args.gemv_rows < 1 or args.gemv_rows > 24:
            raise ValueError("--gemv-rows: from 1 (decode) to 24 (the most rows the C++ kernel takes in the engine)")
        shapes = parse_shapes(args.gemv_shapes)
    except ValueError as err:
        print(f"ninfer-bench: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with LoadMeter() as meter:
            out = run(formats, shapes, args.gemv_rows, args.repeat)
    except RuntimeError as err:
        print(f"ninfer-bench: {err}", file=sys.stderr)
        return 1
    load = f"{meter.cores:.2f} cores (mean while benchmarking; 0 = quiet machine)"
    print(f"NInfer GEMV benchmark: {command.strip()}\n  threads {torch.get_num_threads()}; other processes' CPU load "
          f"{load}\n\n{out['table']}")
    if args.json:
        args.json.write_text(json.dumps(dict(command=command.strip(), load=load, threads=torch.get_num_threads(),
                                             **{k: v for k, v in out.items() if k != "table"}), indent=2))
    return 0
