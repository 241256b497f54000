"""CPU timing of the quantized-linear paths on SmolLM2-135M shapes (not a test; the numbers go to docs/KERNELS.md).

    python -m tests.kernels.bench_cpu [--threads 2] [--min-time 0.3] [--repeat 2] [--shapes all|0,2] [--paths C++,bf16]

Activations come in and go out as float32 (the engine's CPU dtype); a "(bf16)" path casts x to bfloat16 for the
ATen op and the result back, and its time includes both casts. Prints a markdown table of microseconds per call
(the fastest block of torch.utils.benchmark's blocked_autorange, over --repeat passes made at different moments:
robust to other processes on the 2 cores) and checks every path against the twin x @ dequantize(qw).T first.
"""
from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb

from kernels import cpu, cpu_native
from kernels.quant import dequantize, quantize_int4, quantize_int8, quantize_ternary

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # (out_features, in_features)
BF16, FP16 = torch.bfloat16, torch.float16


def timeit(fn, min_time: float) -> float:
    fn()
    m = tb.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_time)
    return min(m.times) * 1e6


def paths(w: torch.Tensor):
    q8, q4, qt = quantize_int8(w), quantize_int4(w, 32, symmetric=False), quantize_ternary(w, 64)
    wb = w.to(BF16)
    return [
        ("fp32 F.linear", None, 0, lambda x: F.linear(x, w)),
        ("bf16 F.linear", None, 0, lambda x: F.linear(x.to(BF16), wb).float()),
        ("int8pack fp32", q8, 1e-5, lambda x: cpu.int8pack_linear(x, q8)),
        ("int8pack (bf16)", q8, 1e-2, lambda x: cpu.int8pack_linear(x, q8, BF16)),
        ("int8pack (fp16)", q8, 2e-3, lambda x: cpu.int8pack_linear(x, q8, FP16)),
        ("int8 deq+F.linear", q8, 1e-5, lambda x: cpu.dequant_linear(x, q8)),
        ("int4pack fp32 g32", q4, 1e-5, lambda x: cpu.int4pack_linear(x, q4)),
        ("int4pack (bf16) g32", q4, 1e-2, lambda x: cpu.int4pack_linear(x, q4, BF16)),
        ("int4pack (fp16) g32", q4, 2e-3, lambda x: cpu.int4pack_linear(x, q4, FP16)),
        ("int4 deq+F.linear g32", q4, 1e-5, lambda x: cpu.dequant_linear(x, q4)),
        ("ternary int4pack (bf16) g64", qt, 1e-2, lambda x: cpu.int4pack_linear(x, qt, BF16)),
        ("ternary deq+F.linear g64", qt, 1e-5, lambda x: cpu.dequant_linear(x, qt)),
    ] + ([] if cpu_native.ready() is not None else [  # the C++ kernel, where it builds (int16 activations)
        ("int4 C++ lowbit_linear g32", q4, 1e-4, lambda x: cpu_native.lowbit_linear(x, q4)),
        ("int8 C++ lowbit_linear", q8, 1e-4, lambda x: cpu_native.lowbit_linear(x, q8)),
    ])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--repeat", type=int, default=2, help="passes over the whole table; each cell keeps its best")
    ap.add_argument("--shapes", default="all", help="'all' or a comma list of indexes into SHAPES")
    ap.add_argument("--paths", default="", help="only the paths whose names contain one of these comma-separated words")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shapes = SHAPES if a.shapes == "all" else [SHAPES[int(i)] for i in a.shapes.split(",")]
    print(f"# {datetime.date.today()} torch {torch.__version__} capability={torch.backends.cpu.get_cpu_capability()} "
          f"threads={torch.get_num_threads()} x=float32 in/out; microseconds per call")
    cells: dict = {}
    weights = {}
    for n, k in shapes:
        words = [w for w in a.paths.split(",") if w]
        weights[(n, k)] = [p for p in paths(torch.randn(n, k) * 0.05) if not words or any(w in p[0] for w in words)]
        for b in (1, 4):
            x = torch.randn(b, k)
            for name, qw, tol, fn in weights[(n, k)]:
                if qw is not None:  # every path is checked against the twin before it is timed
                    ref = x @ dequantize(qw).T
                    err = ((fn(x) - ref).abs().max() / ref.abs().max()).item()
                    assert err < tol, (name, n, k, b, err)
    for _ in range(a.repeat):
        for (n, k), ps in weights.items():
            for b in (1, 4):
                x = torch.randn(b, k)
                for name, _qw, _tol, fn in ps:
                    t = timeit(lambda: fn(x), a.min_time)
                    cells[(n, k, b, name)] = min(t, cells.get((n, k, b, name), float("inf")))
    names = [p[0] for p in next(iter(weights.values()))]
    print("| out x in | batch | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for n, k in shapes:
        for b in (1, 4):
            print(f"| {n}x{k} | {b} | " + " | ".join(f"{cells[(n, k, b, nm)]:.0f}" for nm in names) + " |")


if __name__ == "__main__":
    main()
