"""``ninfer-bench``: single-request latency and throughput of our engine, side by side with a peer (HF transformers
by default, or llama.cpp).

Both run on the same model, dtype, device, thread count and prompt token ids, with greedy decoding that never stops
early: transformers in this process after NInfer; llama.cpp in a child process, loaded first, its runs alternating
with NInfer's (so a machine whose speed drifts moves both alike). Each measurement is a discarded warm-up run
followed by ``--repeat`` runs, of which the median is reported (engine/tools/bench/measure.py). Other modes:
``--spec`` (speculative.py), ``--warm-prefix`` (below), ``--via-api`` (api.py), ``--profile-steps``
(step_profile.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from engine.build import build_engine
from engine.errors import NInferError
from engine.sampling import SamplingParams
from engine.tools.bench import api, gemv, peer_llamacpp, speculative, step_profile
from engine.tools.bench.machine import LoadMeter, machine_facts, measure_read_bandwidth
from engine.tools.bench.measure import (add_roofline, bench_engine, build_prompt, decode_bytes_per_token, format_table,
                                        ratios, summarise)
from engine.tools.bench.peer_transformers import bench_transformers, load_transformers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-bench", description="Benchmark NInfer against HF transformers "
                                "(one request: time to first token, prefill and decode speed, bandwidth).")
    p.add_argument("model", nargs="?", default=None, help="a .gguf file or HF folder (default: embedded SmolLM2)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    p.add_argument("--gen-tokens", type=int, default=128, help="tokens to generate, at least 2 (default 128)")
    p.add_argument("--repeat", type=int, default=3, help="measured runs after one warm-up; median (default 3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both engines (default: torch's)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and KV dtype (both)")
    p.add_argument("--weight-dtype", choices=("same", "auto", "int8", "int4"), default="same",
                   help="NInfer's weights: same = --dtype (like for like); auto = as the GGUF stores them (Q4_1 -> "
                        "int4); transformers always runs --dtype")
    p.add_argument("--kv-dtype", choices=("same", "fp32", "fp16", "bf16"), default="same",
                   help="NInfer's KV cache: same = as the peer keeps it (transformers: --dtype; llama.cpp: fp16, its "
                        "default f16 cache); or this format")
    p.add_argument("--compare", choices=("transformers", "llama.cpp", "none"), default="transformers",
                   help="the peer measured in the same run (llama.cpp: needs llama-cpp-python and a GGUF model)")
    p.add_argument("--json", type=Path, default=None, help="write all results to this JSON file")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--spec", choices=("ngram", "draft", "mtp"), default=None,
                   help="instead: decode speed with this speculative method vs without, on repetitive, code and "
                        "prose content (greedy, stops at end of turn; --gen-tokens is the most generated)")
    p.add_argument("--warm-prefix", action="store_true",
                   help="instead: time to first token of a --prompt-tokens prompt sent cold, then again (its cached "
                        "prefix reused), then with one token changed at the end")
    p.add_argument("--draft-model", default=None, help="the draft model for --spec draft")
    p.add_argument("--draft-tokens", type=int, default=0, help="draft length ceiling for --spec (0: its default)")
    p.add_argument("--kv-window", type=int, default=0,
                   help="NInfer only: keep this many recent tokens on the device, older pages in host memory "
                        "(needs --host-kv-mib; see docs/KV.md)")
    p.add_argument("--kv-retrieve", type=int, default=0, help="NInfer only: older tokens brought back per step")
    p.add_argument("--host-kv-mib", type=int, default=0, help="NInfer only: host KV memory for --kv-window")
    p.add_argument("--max-context", type=int, default=0, help="NInfer's context (0: the model's)")
    p.add_argument("--prefill-cublas", action="store_true",
                   help="NInfer only: low-bit layers run prefill chunks as dense matmuls (--prefill-cublas true)")
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                   help="NInfer only: decode steps replayed as CUDA graphs (auto: on with CUDA and Triton)")
    p.add_argument("--cpu-compile", choices=("auto", "step", "off"), default="auto",
                   help="NInfer only: a low-bit model's CPU paths: C++ kernels for the output layer and the decode "
                        "step (one C++ call a step for a llama-family model), dense prompts (auto); the same with the "
                        "decode step of one sequence as one compiled graph (step); or a dense float32 output layer "
                        "and ATen's kernels (off)")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="NInfer only: also profile N decode steps by operator, ATen and the project's C++ kernels "
                        "(torch.profiler)")
    p.add_argument("--gemv", action="store_true",
                   help="instead: the C++ low-bit GEMVs alone at sizes beyond the last-level cache, in GB/s against "
                        "the stream read bandwidth (engine/tools/bench/gemv.py; no model is loaded)")
    p.add_argument("--gemv-formats", default=",".join(gemv.FORMATS), help="for --gemv: weight formats (default: all)")
    p.add_argument("--gemv-shapes", default=gemv.DEFAULT_SHAPES, help="for --gemv: OUTxIN weight shapes")
    p.add_argument("--gemv-rows", type=int, default=1, help="for --gemv: rows of activations (1: decode)")
    p.add_argument("--via-api", action="store_true",
                   help="also measure through the HTTP server (streaming) and compare with engine-direct")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt_tokens < 1 or args.gen_tokens < 2 or args.repeat < 1 or args.profile_steps < 0:
        print("ninfer-bench: need --prompt-tokens >= 1, --gen-tokens >= 2, --repeat >= 1 and --profile-steps >= 0",
              file=sys.stderr)
        return 2
    threads_before = torch.get_num_threads()
    try:
        if args.gemv:
            return gemv.run_from_args(args, "ninfer-bench " + " ".join(argv if argv is not None else sys.argv[1:]))
        return _run(args, "ninfer-bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests): leave no trace


def _run(args, command: str) -> int:
    if args.compare == "llama.cpp":
        try:
            peer_llamacpp.check_installed()
        except RuntimeError as err:
            print(f"ninfer-bench: {err}", file=sys.stderr)
            return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    try:
        weights = args.dtype if args.weight_dtype == "same" else args.weight_dtype
        spec = dict(spec=args.spec, draft_model=args.draft_model, draft_tokens=args.draft_tokens) if args.spec else {}
        loaded = build_engine(args.model, device=args.device, weight_dtype=weights, kv_dtype=kv_dtype(args),
                              max_concurrency=1, threads=args.threads,
                              max_context=args.max_context or (4096 if args.spec else 0),
                              max_shared_prefixes="auto" if args.warm_prefix else 0,  # else: every run prefills
                              kv_window=args.kv_window, kv_retrieve=args.kv_retrieve, host_kv_mib=args.host_kv_mib,
                              prefill_cublas=args.prefill_cublas, cuda_graphs=args.cuda_graphs,
                              cpu_compile=args.cpu_compile, **spec)
    except NInferError as err:
        print(f"ninfer-bench: {err}", file=sys.stderr)
        return 1
    if args.prompt_tokens + args.gen_tokens > loaded.context_window:
        print(f"ninfer-bench: prompt + generated tokens exceed the context of {loaded.context_window}",
              file=sys.stderr)
        return 2
    if args.spec:
        return _run_spec(args, loaded, threads, command)
    if args.warm_prefix:
        return _run_warm_prefix(args, loaded, command)
    prompt = build_prompt(loaded.tokenizer, args.prompt_tokens)
    theirs = ratio = through_api = peer_error = None
    with LoadMeter() as meter:
        peer = peer_runs = None
        if args.compare == "llama.cpp":  # loaded first; its runs alternate with NInfer's
            try:
                peer = peer_llamacpp.PeerProcess(loaded.path, threads, args.prompt_tokens + args.gen_tokens + 16,
                                                 prompt, args.gen_tokens)
                peer_runs = []
            except RuntimeError as err:
                peer_error = str(err)

        def peer_turn(i: int) -> None:  # after NInfer's run i, the peer's run i (0: the warm-up of each)
            nonlocal peer_error
            if peer is None or peer_error:
                return
            try:
                run = peer.run()
            except RuntimeError as err:
                peer_error = str(err)
            else:
                if i:
                    peer_runs.append(run)

        try:
            ours = bench_engine(loaded, prompt, args.gen_tokens, args.repeat, between=peer_turn)
            if args.via_api:
                through_api = api.bench_via_api(loaded, prompt, args.gen_tokens, args.repeat)
        finally:
            loaded.engine.shutdown()
            if peer is not None:
                peer.close()
        profiled = None
        if args.profile_steps > 0:
            profiled = step_profile.profile_decode(loaded.engine, prompt, args.profile_steps)
        if args.compare == "transformers":
            model = load_transformers(loaded.path, loaded.dtype, loaded.device)
            theirs = bench_transformers(model, prompt, args.gen_tokens, args.repeat)
            ratio = ratios(ours, theirs)
            del model
        elif peer_runs and not peer_error:
            cfg = loaded.config
            kv_layers = cfg.layer_kinds.count("attention") if cfg.layer_kinds else cfg.num_layers
            kv_f16 = 2 * kv_layers * cfg.num_kv_heads * cfg.head_dim * 2  # llama.cpp's default KV type
            theirs = dict(summarise(peer_runs, len(prompt), args.gen_tokens, decode_bytes_per_token(
                peer.weight_bytes, kv_f16, len(prompt), args.gen_tokens)), weight_bytes=peer.weight_bytes)
            ratio = ratios(ours, theirs)
    stream = measure_read_bandwidth(loaded.device)  # after the runs: the peer's memory is freed
    facts = machine_facts(loaded, threads, stream)
    for column in (ours, theirs):
        if column:
            add_roofline(column, stream["gbps"])
    facts["other processes' CPU load"] = f"{meter.cores:.2f} cores (mean while benchmarking; 0 = quiet machine)"
    facts["decode steps"] = decode_path(loaded.engine.runner)
    command = command.strip()
    print(format_table(facts, ours, theirs, ratio, command, peer=args.compare))
    if args.via_api:
        print(api.format_api_table(ours, through_api))
    if profiled:
        print(f"\ndecode step profile: {profiled['steps']} steps, {profiled['aten_calls_per_step']:.0f} operator calls "
              f"(ATen and ninfer_cpu) and {profiled['ms_per_step']:.1f} ms a step under the profiler\n"
              f"{profiled['table']}")
    if peer_error:
        print(f"ninfer-bench: {peer_error}", file=sys.stderr)
    if args.json:
        peer = {"peer": args.compare, args.compare: theirs} if theirs else {"peer": None}  # under its own name
        result = dict(command=command, machine=facts, stream_read=stream, prompt_tokens=args.prompt_tokens,
                      gen_tokens=args.gen_tokens, repeat=args.repeat, ninfer=ours, **peer, ratio=ratio, via_api=through_api,
                      profile=profiled and {k: v for k, v in profiled.items() if k != "table"},
                      **({"peer_error": peer_error} if peer_error else {}))
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if peer_error else 0


def kv_dtype(args) -> str:
    """NInfer's KV format: --kv-dtype, or with `same` the peer's (llama.cpp keeps an f16 cache by default;
    transformers keeps --dtype)."""
    if args.kv_dtype != "same":
        return args.kv_dtype
    return "fp16" if args.compare == "llama.cpp" else args.dtype


def decode_path(runner) -> str:
    """How NInfer's decode steps ran: CUDA graphs, the static forward, (--cpu-compile step) the compiled step or
    (--cpu-compile auto on the CPU) one C++ call each."""
    graphs = runner.graphs
    path = "replayed as CUDA graphs" if graphs.capture else "through the static forward"
    if graphs.fused is not None:
        return f"{graphs.steps}, {graphs.fused.steps} of them as one C++ call ({graphs.fused.source})"
    if graphs.compiled is None:
        return f"{graphs.steps} {path}"
    return f"{graphs.steps}, {graphs.compiled.steps} of them as one compiled graph (--cpu-compile step)"


def _run_warm_prefix(args, loaded, command: str) -> int:
    engine = loaded.engine.start()
    prompt = build_prompt(loaded.tokenizer, args.prompt_tokens)
    rows = []
    try:
        for label, ids in (("cold", prompt), ("warm (same prompt)", prompt),
                           ("warm (last token changed)", prompt[:-1] + [prompt[0]])):
            before = engine.stats()["prefix_hit_tokens"]
            t0 = time.perf_counter()
            next(iter(engine.submit(list(ids), SamplingParams(max_tokens=1, temperature=0.0))))
            rows.append((label, time.perf_counter() - t0, engine.stats()["prefix_hit_tokens"] - before))
    finally:
        engine.shutdown()
    lines = [f"NInfer prefix-reuse benchmark: {command.strip()}", "",
             "| request | TTFT (ms) | vs cold | prompt tokens reused |", "|---|---|---|---|"]
    for label, seconds, hit in rows:
        lines.append(f"| {label} | {seconds * 1e3:.1f} | {seconds / rows[0][1]:.4f} | {hit} of {len(prompt)} |")
    print("\n".join(lines))
    return 0


def _run_spec(args, loaded, threads: int, command: str) -> int:
    with LoadMeter() as meter:
        results = speculative.run_spec_bench(args, loaded)
    facts = machine_facts(loaded, threads)
    facts["other processes' CPU load"] = f"{meter.cores:.2f} cores (mean while benchmarking; 0 = quiet machine)"
    lines = ["NInfer speculative-decoding benchmark: " + command.strip()]
    lines += [f"  {k:<26} {v}" for k, v in facts.items()]
    print("\n".join(lines) + "\n\n" + speculative.format_spec_table(args.spec, results))
    if args.json:
        args.json.write_text(json.dumps(dict(command=command.strip(), machine=facts, spec=args.spec,
                                             results=results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
