"""``ninfer-bench``: single-request latency and throughput of our engine, side by side with HF transformers.

Both run in this process on the same model, dtype, device, thread count and prompt token ids, with greedy
decoding that never stops early. Each measurement is a discarded warm-up run followed by ``--repeat`` runs,
of which the median is reported. Decode bandwidth is reported the way gpt-fast does: the bytes one decode
step must read (all weights, plus the KV cache at the mean context) times decode tokens per second.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench_machine import LoadMeter, machine_facts

# Deterministic English filler; repeated until the prompt is long enough, then cut to the exact token count.
FILLER = (
    "The history of the lighthouse is a story of engineering, weather and patience. Early keepers burned wood "
    "and coal in open braziers on towers of stone, and sailors learned to read the coast by the rhythm of the "
    "lights. Later lamps used oil and mirrors, then glass lenses that bent the beam into a narrow band visible "
    "for many miles. Each station kept a logbook of storms, ships and repairs, and the keepers trimmed wicks, "
    "polished brass and wound the clockwork that turned the lens through the night. "
)
METRICS = (  # key, label, format, whether higher is better
    ("ttft_s", "TTFT (ms)", lambda v: f"{v * 1e3:.1f}", False),
    ("prefill_tps", "prefill tok/s", lambda v: f"{v:.1f}", True),
    ("decode_tps", "decode tok/s", lambda v: f"{v:.2f}", True),
    ("decode_gbps", "decode GB/s", lambda v: f"{v:.2f}", True),
)


def build_prompt(tokenizer, n: int) -> list[int]:
    """Exactly n token ids of the filler text, as our tokenizer encodes it (no special tokens)."""
    text, ids = FILLER, tokenizer.encode(FILLER)
    while len(ids) < n:
        text += FILLER
        ids = tokenizer.encode(text)
    return ids[:n]


def decode_bytes_per_token(weight_bytes: int, kv_bytes_per_position: int, prompt_tokens: int, gen_tokens: int) -> float:
    """Bytes one decode step reads: every weight, plus the KV at the mean decode context. Decode steps see
    contexts prompt+1 .. prompt+gen-1, whose mean is prompt + gen/2."""
    return weight_bytes + kv_bytes_per_position * (prompt_tokens + gen_tokens / 2)


def _summarise(runs: list[dict], prompt_tokens: int, gen_tokens: int, bytes_per_token: float) -> dict:
    ttft = statistics.median(r["ttft_s"] for r in runs)
    decode = statistics.median(r["decode_s"] for r in runs)
    decode_tps = (gen_tokens - 1) / decode
    return dict(ttft_s=ttft, prefill_tps=prompt_tokens / ttft, decode_tps=decode_tps,
                decode_gbps=bytes_per_token * decode_tps / 1e9, bytes_per_decode_token=bytes_per_token,
                runs=[{k: v for k, v in r.items() if k != "tokens"} for r in runs], tokens=runs[-1]["tokens"])


def bench_engine(loaded, prompt_ids: list[int], gen_tokens: int, repeat: int = 3) -> dict:
    """Our engine, batch 1, through Engine.submit on the engine thread (started here if needed).
    TTFT = submit -> first output (includes the prefill); decode = first output -> last output. Build the engine
    with max_shared_prefixes=0, or runs after the first reuse the prompt's cached KV instead of prefilling it."""
    from engine.sampling import SamplingParams

    engine = loaded.engine
    engine.start()
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    hits_before = engine.stats().get("prefix_hit_tokens", 0)
    runs = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        stamps, tokens = [], []
        for out in engine.submit(list(prompt_ids), params):
            if out.error:
                raise RuntimeError(out.error)
            now = time.perf_counter()
            for token in out.token_ids:
                stamps.append(now)
                tokens.append(token)
        if len(tokens) != gen_tokens:
            raise RuntimeError(f"the engine produced {len(tokens)} tokens, expected {gen_tokens}")
        if i:  # run 0 is the warm-up
            runs.append(dict(ttft_s=stamps[0] - t0, decode_s=stamps[-1] - stamps[0], tokens=tokens))
    kv_per_pos = engine.runner.kv.token_bytes  # 2 * layers * kv_heads * head_dim * element size, for floats
    weights = engine.runner.model.weight_bytes()
    return dict(_summarise(runs, len(prompt_ids), gen_tokens, decode_bytes_per_token(
        weights, kv_per_pos, len(prompt_ids), gen_tokens)), weight_bytes=weights,
        prefix_hit_tokens=engine.stats().get("prefix_hit_tokens", 0) - hits_before)  # 0 unless KV was reused


def load_transformers(path: Path, dtype: torch.dtype, device: torch.device):
    """The same model in HF transformers: a GGUF (dequantized to dtype) or an HF folder."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    path = Path(path)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


def bench_transformers(model, prompt_ids: list[int], gen_tokens: int, repeat: int = 3) -> dict:
    """HF generate, greedy, batch 1. TTFT = generate(max_new_tokens=1); decode tok/s =
    (N-1) / (t(generate N) - TTFT)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    mask = torch.ones_like(ids)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (model.generation_config.eos_token_id or 0)
    pad = pad[0] if isinstance(pad, list) else pad

    def timed(n: int) -> tuple[float, list[int]]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, out[0, len(prompt_ids):].tolist()

    runs = []
    for i in range(repeat + 1):
        t_first, _ = timed(1)
        t_all, tokens = timed(gen_tokens)
        if i:
            runs.append(dict(ttft_s=t_first, decode_s=max(t_all - t_first, 1e-9), tokens=tokens))
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    elem = next(model.parameters()).element_size()
    # Read per token, as LlamaModel.weight_bytes counts: every parameter (tied ones once) except the input
    # embedding table, of which one row is read, unless it is also the output layer.
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        weights -= embed.numel() * embed.element_size()
    kv_per_pos = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem
    return dict(_summarise(runs, len(prompt_ids), gen_tokens, decode_bytes_per_token(
        weights, kv_per_pos, len(prompt_ids), gen_tokens)), weight_bytes=weights)


def ratios(ours: dict, theirs: dict) -> dict:
    """> 1 always means ours is better: throughput ours/theirs, TTFT theirs/ours."""
    return {key: (ours[key] / theirs[key] if higher else theirs[key] / ours[key])
            for key, _, _, higher in METRICS if ours.get(key) and theirs.get(key)}


def format_table(facts: dict, ours: dict, theirs: dict | None, ratio: dict | None, command: str = "",
                 peer: str = "transformers") -> str:
    peer = peer if theirs else "transformers"
    lines = ["NInfer benchmark" + (f": {command}" if command else "")]
    lines += [f"  {k:<26} {v}" for k, v in facts.items()]
    head = f"| {'metric':<14} | {'ninfer':>10} | {peer:>12} | {'ratio':>6} |"
    lines += ["", head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for key, label, fmt, _ in METRICS:
        other = fmt(theirs[key]) if theirs else "-"
        r = f"{ratio[key]:.2f}" if ratio and key in ratio else "-"
        lines.append(f"| {label:<14} | {fmt(ours[key]):>10} | {other:>12} | {r:>6} |")
    lines.append("")
    lines.append(f"ratio > 1 means ninfer is better: ninfer/{peer} for throughput, {peer}/ninfer for TTFT.")
    if theirs:
        same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])) if a != b),
                    len(ours["tokens"]))
        lines.append(f"greedy outputs agree on the first {same} of {len(ours['tokens'])} tokens.")
    return "\n".join(lines)


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
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="NInfer only: also profile N decode steps by ATen operator (torch.profiler)")
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
        return _run(args, "ninfer-bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests): leave no trace


def _run(args, command: str) -> int:
    from engine.build import build_engine
    from engine.errors import NInferError

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    try:
        weights = args.dtype if args.weight_dtype == "same" else args.weight_dtype
        spec = dict(spec=args.spec, draft_model=args.draft_model, draft_tokens=args.draft_tokens) if args.spec else {}
        loaded = build_engine(args.model, device=args.device, weight_dtype=weights, kv_dtype=args.dtype,
                              max_concurrency=1, threads=args.threads,
                              max_context=args.max_context or (4096 if args.spec else 0),
                              max_shared_prefixes="auto" if args.warm_prefix else 0,  # else: every run prefills
                              kv_window=args.kv_window, kv_retrieve=args.kv_retrieve, host_kv_mib=args.host_kv_mib,
                              prefill_cublas=args.prefill_cublas, cuda_graphs=args.cuda_graphs, **spec)
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
    theirs = ratio = None
    with LoadMeter() as meter:
        try:
            ours = bench_engine(loaded, prompt, args.gen_tokens, args.repeat)
            if args.via_api:
                from engine.bench_api import bench_via_api
                api = bench_via_api(loaded, prompt, args.gen_tokens, args.repeat)
        finally:
            loaded.engine.shutdown()
        profiled = None
        if args.profile_steps > 0:
            from engine.bench_profile import profile_decode
            profiled = profile_decode(loaded.engine, prompt, args.profile_steps)
        if args.compare == "transformers":
            model = load_transformers(loaded.path, loaded.dtype, loaded.device)
            theirs = bench_transformers(model, prompt, args.gen_tokens, args.repeat)
            ratio = ratios(ours, theirs)
            del model
        elif args.compare == "llama.cpp":
            from engine.bench_llamacpp import bench_llamacpp, load_llamacpp
            try:
                llm = load_llamacpp(loaded.path, threads, args.prompt_tokens + args.gen_tokens + 16)
            except RuntimeError as err:
                print(f"ninfer-bench: {err}", file=sys.stderr)
                return 1
            cfg = loaded.config
            kv_f16 = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # llama.cpp's default KV type
            theirs = bench_llamacpp(llm, prompt, args.gen_tokens, args.repeat, lambda runs, weight_bytes: _summarise(
                runs, len(prompt), args.gen_tokens,
                decode_bytes_per_token(weight_bytes, kv_f16, len(prompt), args.gen_tokens)))
            ratio = ratios(ours, theirs)
            del llm
    facts = machine_facts(loaded, threads)
    facts["other processes' CPU load"] = f"{meter.cores:.2f} cores (mean while benchmarking; 0 = quiet machine)"
    command = command.strip()
    print(format_table(facts, ours, theirs, ratio, command, peer=args.compare))
    if args.via_api:
        from engine.bench_api import format_api_table
        print(format_api_table(ours, api))
    if profiled:
        print(f"\ndecode step profile: {profiled['steps']} steps, {profiled['aten_calls_per_step']:.0f} ATen calls "
              f"and {profiled['ms_per_step']:.1f} ms a step under the profiler\n{profiled['table']}")
    if args.json:
        peer = {"peer": args.compare, args.compare: theirs} if theirs else {"peer": None}  # under its own name
        result = dict(command=command, machine=facts, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                      repeat=args.repeat, ninfer=ours, **peer, ratio=ratio, via_api=api if args.via_api else None,
                      profile=profiled and {k: v for k, v in profiled.items() if k != "table"})
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _run_warm_prefix(args, loaded, command: str) -> int:
    from engine.sampling import SamplingParams

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
    from engine.bench_spec import format_spec_table, run_spec_bench

    with LoadMeter() as meter:
        results = run_spec_bench(args, loaded)
    facts = machine_facts(loaded, threads)
    facts["other processes' CPU load"] = f"{meter.cores:.2f} cores (mean while benchmarking; 0 = quiet machine)"
    lines = ["NInfer speculative-decoding benchmark: " + command.strip()]
    lines += [f"  {k:<26} {v}" for k, v in facts.items()]
    print("\n".join(lines) + "\n\n" + format_spec_table(args.spec, results))
    if args.json:
        args.json.write_text(json.dumps(dict(command=command.strip(), machine=facts, spec=args.spec,
                                             results=results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
