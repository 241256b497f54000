"""Decode with each of the C++ low-bit GEMV's code paths (kernels/cpu_native.gemv_paths: AVX2, AVX-512 VNNI),
alternating in one process (A, B, A, B, ...) on one engine: decode tok/s per path (median), the roofline fraction
against the stream read bandwidth, and whether the greedy tokens agree.

    python scripts/bench_gemv_paths.py [MODEL] [--rounds 5] [--prompt-tokens 512] [--gen-tokens 128] [--threads 2]

MODEL defaults to the embedded SmolLM2-135M (Q4_1, kept as int4: every decode step one C++ call). Prints one
markdown table; other processes' CPU load beside it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.build import build_engine  # noqa: E402
from engine.tools.bench.machine import LoadMeter, describe_stream, measure_read_bandwidth  # noqa: E402
from engine.tools.bench.measure import bench_engine, build_prompt  # noqa: E402
from kernels import cpu_native  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = build_engine(args.model, device="cpu", weight_dtype="auto", max_concurrency=1, max_shared_prefixes=0,
                          threads=args.threads)
    paths = cpu_native.gemv_paths()
    prompt = build_prompt(loaded.tokenizer, args.prompt_tokens)
    runs = {p: [] for p in paths}
    tokens = {}
    with LoadMeter() as meter:
        for i in range(args.rounds + 1):  # round 0: each path's warm-up
            for p in paths:
                with cpu_native.gemv_path(p):
                    r = bench_engine(loaded, prompt, args.gen_tokens, repeat=1)
                if i:
                    runs[p].append(r)
                tokens[p] = r["tokens"]
    loaded.engine.shutdown()
    stream = measure_read_bandwidth(torch.device("cpu"))
    per_token = runs[paths[0]][0]["bytes_per_decode_token"]
    print(f"scripts/bench_gemv_paths.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"  model {loaded.path.name}, weights {loaded.engine.runner.model.weight_format}, threads "
          f"{torch.get_num_threads()}, {per_token / 1e6:.1f} MB read per decode token")
    print(f"  stream read bandwidth {describe_stream(stream)}")
    print(f"  other processes' CPU load {meter.cores:.2f} cores (mean; 0 = quiet machine)\n")
    print("| path | decode tok/s (each round) | median | decode GB/s | of roofline | TTFT ms (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in paths:
        tps = [r["decode_tps"] for r in runs[p]]
        med = statistics.median(tps)
        ttft = statistics.median(r["ttft_s"] for r in runs[p]) * 1e3
        print(f"| {p} | {' / '.join(f'{v:.1f}' for v in tps)} | {med:.1f} | {per_token * med / 1e9:.2f} | "
              f"{per_token * med / (stream['gbps'] * 1e9):.2f} | {ttft:.0f} |")
    first = tokens[paths[0]]
    for p in paths[1:]:
        same = next((i for i, (a, b) in enumerate(zip(first, tokens[p])) if a != b), len(first))
        print(f"\ngreedy tokens of {p} agree with {paths[0]}'s on the first {same} of {len(first)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
