"""The body of scripts/gpu_check.sh: what a GPU machine must show, in one short run.

    python -m engine.tools.gpu_check [--out DIR] [--device auto|cuda|cpu] [--tiny] [--memory-cap-gib 12] [--skip-tests]

1. environment (torch, CUDA, Triton, the GPU, its memory);
2. every kernel test on the device (tests/kernels with NINFER_TEST_DEVICE=cuda: compiled kernels, not the
   interpreter);
3. the two ceilings measured: device-to-device copy bandwidth (bytes read + written) and a bf16 matmul;
4. each weight format's decode GEMV (int8, int4, ternary) at 27B shapes, as GB/s of weight bytes and % of copy;
5. paged decode attention at 4K / 32K / 128K context over float (bf16) pages and the quantized k8v4 and k4v4 pages
   (codes and fp16 scales read in the kernel), as GB/s of K/V bytes read (codes + scales) and % of copy;
6. end to end on a synthetic 27B-shaped llama (random ternary and int4 weights built on the device, capped to
   --memory-cap-gib with torch.cuda.set_per_process_memory_fraction): decode tok/s with CUDA graphs and eager
   (and whether both give the same greedy tokens) against the roofline (copy bandwidth / bytes read per token), and
   prefill tok/s with the low-bit kernels and with --prefill-cublas (dequantize + cuBLAS);
7. end to end on a synthetic Qwen3.5-27B-shaped Gated-DeltaNet hybrid (ternary, engine/tools/gpu_check_hybrid.py):
   prefill tok/s to 32K, decode tok/s at 4K and 32K context (graphs and eager) against the roofline, the recurrent
   state bytes per sequence and the KV bytes per token.
It prints a short table last and writes every number to DIR/gpu_check.json. --tiny shrinks every shape so the
same code runs in seconds on a CPU (the test suite does that); --device cpu without --tiny is allowed but slow."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.memory.geometry import PAGE_SIZE
from engine.model.config import ModelConfig
from engine.model.linear import PREFILL_DENSE_ROWS
from engine.model.llama import LlamaModel
from engine.model.weights import LoadedWeights
from engine.runner import ModelRunner, Work
from engine.tools.gpu_check_hybrid import TINY_HYBRID, HybridShape, end_to_end_hybrid, table_rows
from engine.tools.synthetic import BITS, GIB, random_weight
from kernels import dispatch



@dataclass(frozen=True)
class Shape:
    """A llama-shaped model (27B-like by default: 64 layers, hidden 5120, GQA 40/8 x 128)."""
    layers: int = 64
    hidden: int = 5120
    heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 22016
    vocab: int = 32000

    def linears(self) -> dict[str, tuple[int, int]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (q, self.hidden), "k_proj": (kv, self.hidden), "v_proj": (kv, self.hidden),
                "o_proj": (self.hidden, q), "gate_proj": (self.intermediate, self.hidden),
                "up_proj": (self.intermediate, self.hidden), "down_proj": (self.hidden, self.intermediate)}


TINY = Shape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=512)
FORMATS = ("int8", "int4_asym", "ternary")
KV_FORMATS = ("float", "k8v4", "k4v4")  # paged attention: the float cache (bf16 on CUDA) and two quantized layouts


# ---------------------------------------------------------------------------------------------------- timing
def timer(device: torch.device):
    """fn -> median milliseconds: CUDA events through triton.testing.do_bench on a GPU, perf_counter elsewhere."""
    if device.type == "cuda":  # triton is needed on a GPU only (environment() reports when it is missing)
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_time(fn):
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return cpu_time


# ---------------------------------------------------------------------------------------------------- pieces
def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": str(device)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", memory_gib=round(p.total_memory / GIB, 1),
                   multiprocessors=p.multi_processor_count)
    return env


# The kernel tests run on the GPU: they need torch, triton, numpy and pytest only (a GPU machine may lack the rest)
KERNEL_TESTS = ("tests/kernels/test_quant.py", "tests/kernels/test_qlinear.py", "tests/kernels/test_elementwise.py",
                "tests/kernels/test_paged_attention.py", "tests/kernels/test_paged_attention_quant.py",
                "tests/kernels/test_gated_delta.py", "tests/kernels/test_fused_moe.py")
PYTEST_ARGS = ("-q", "-p", "no:cacheprovider", "-o", "addopts=-ra")


def kernel_tests(device: torch.device, out: Path) -> dict:
    env = dict(os.environ, NINFER_TEST_DEVICE=device.type, HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    # -o addopts=: one process on the one GPU, and pytest-xdist (the default options' -n) may not be installed there
    run = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *KERNEL_TESTS],
                         env=env, capture_output=True, text=True)
    (out / "kernel_tests.log").write_text(run.stdout + run.stderr)
    return {"returncode": run.returncode, "summary": pytest_summary(run.stdout), "seconds": time.perf_counter() - t0}


def pytest_summary(stdout: str) -> str:
    """pytest's closing count ("12 passed, 1 failed in 3.4s", with or without its ===), or its last line."""
    lines = [line.strip("= ") for line in stdout.splitlines() if line.strip()]
    counted = re.compile(r"^\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b.* in [\d.]+s")
    return next((line for line in reversed(lines) if counted.match(line)), lines[-1] if lines else "no output")


def ceilings(device: torch.device, tiny: bool, ms) -> dict:
    n = (16 if tiny else 1024) * 2**20
    a = torch.randn(n // 4, device=device)
    b = torch.empty_like(a)
    copy_ms = ms(lambda: b.copy_(a))
    dim = 256 if tiny else 8192
    x = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    y = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    mm_ms = ms(lambda: x @ y)
    return {"copy_gbps": 2 * n / copy_ms / 1e6, "bf16_tflops": 2 * dim**3 / mm_ms / 1e9}


def gemv(device: torch.device, shape: Shape, ms, copy_gbps: float) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for fmt in FORMATS:
        for name in ("q_proj", "gate_proj", "down_proj"):
            out_f, in_f = shape.linears()[name]
            w = random_weight(fmt, out_f, in_f, device)
            x = torch.randn(1, in_f, device=device, dtype=dtype)
            t = ms(lambda: dispatch.linear(x, w))
            gbps = w.nbytes / t / 1e6
            rows.append({"format": fmt, "layer": name, "shape": [out_f, in_f], "us": t * 1e3, "gbps": gbps,
                         "pct_copy": 100 * gbps / copy_gbps})
    return rows


def kv_pages(fmt: str, pages: int, page: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
    """Random K/V pages of one layer in the KVCache layout: (k, v, k_scale, v_scale); the scales are None for
    "float" pages (of `dtype`). Quantized: int8 codes [.., D] with one fp16 scale, or packed int4 [.., D/2] with
    fp16 scales per group of 32 (docs/KV.md)."""
    lead = (pages, page, heads)
    if fmt == "float":
        return torch.randn(*lead, dim, device=device, dtype=dtype), torch.randn(*lead, dim, device=device,
                                                                                dtype=dtype), None, None

    def part(bits):
        if bits == 8:
            codes = torch.randint(-127, 128, (*lead, dim), dtype=torch.int8, device=device)
            groups = 1
        else:
            codes = torch.randint(0, 256, (*lead, dim // 2), dtype=torch.uint8, device=device)
            groups = dim // 32
        return codes, (torch.rand(*lead, groups, device=device) * 0.02 + 0.001).half()

    (k, ks), (v, vs) = part(int(fmt[1])), part(int(fmt[3]))
    return k, v, ks, vs


def attention(device: torch.device, shape: Shape, ms, tiny: bool, copy_gbps: float) -> list[dict]:
    """Paged decode attention of one sequence (all query heads) per KV format and context: GB/s of the K/V bytes
    the step reads (codes and scales for the quantized formats)."""
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    page = PAGE_SIZE
    for fmt in KV_FORMATS:
        for ctx in ((256, 1024) if tiny else (4096, 32768, 131072)):
            pages = ctx // page
            k, v, ks, vs = kv_pages(fmt, pages, page, shape.kv_heads, shape.head_dim, dtype, device)
            q = torch.randn(1, shape.heads, shape.head_dim, device=device, dtype=dtype)
            table = torch.randperm(pages, device=device, dtype=torch.int32)[None]
            lens = torch.tensor([ctx], device=device, dtype=torch.int32)
            t = ms(lambda: dispatch.paged_decode_attention(q, k, v, table, lens, k_scale=ks, v_scale=vs))
            kv_bytes = sum(x.numel() * x.element_size() for x in (k, v, ks, vs) if x is not None)
            gbps = kv_bytes / t / 1e6
            rows.append({"format": fmt if fmt != "float" else str(dtype).replace("torch.", ""), "context": ctx,
                         "kv_mib": kv_bytes / 2**20, "us": t * 1e3, "gbps": gbps, "pct_copy": 100 * gbps / copy_gbps})
    return rows


def synthetic_model(shape: Shape, fmt: str, device: torch.device):
    """A LlamaModel of `shape` with random `fmt` linear weights (bf16 on CUDA, fp32 on the CPU)."""
    cfg = ModelConfig(arch="llama", vocab_size=shape.vocab, hidden_size=shape.hidden, num_layers=shape.layers,
                      num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                      intermediate_size=shape.intermediate, max_position=8192, name=f"synthetic-{fmt}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors = {"model.embed_tokens.weight": torch.randn(shape.vocab, shape.hidden, device=device, dtype=dtype) * 0.02,
               "model.norm.weight": torch.ones(shape.hidden, device=device, dtype=dtype),
               "lm_head.weight": random_weight("int8", shape.vocab, shape.hidden, device)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(shape.hidden, device=device, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(shape.hidden, device=device, dtype=dtype)
        for name, (out_f, in_f) in shape.linears().items():
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            tensors[f"{p}{part}.{name}.weight"] = random_weight(fmt, out_f, in_f, device)
    weight_fmt = {"int4_asym": "int4"}.get(fmt, fmt)
    return LlamaModel(LoadedWeights(cfg, tensors, "synthetic"), dtype, device, weight_fmt)


def end_to_end(device: torch.device, shape: Shape, fmt: str, copy_gbps: float, cap_gib: float, tiny: bool) -> dict:
    """Decode and prefill tok/s of the synthetic model; layers are cut (and said so) when the weights would not fit
    the memory cap with room for the KV cache and activations."""
    per_layer = sum(o * i for o, i in shape.linears().values()) * BITS[fmt] / 8
    budget = cap_gib * GIB * 0.8 - shape.vocab * shape.hidden * 3
    layers = max(1, min(shape.layers, int(budget // per_layer))) if device.type == "cuda" else shape.layers
    cut = Shape(**{**shape.__dict__, "layers": layers})
    model = synthetic_model(cut, fmt, device)
    prompt_len, steps = (64, 4) if tiny else (2048, 32)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(device)
                                                       .total_memory), device)
        torch.cuda.reset_peak_memory_stats(device)
    # CUDA graphs on a GPU (the static decode path called directly elsewhere), and --prefill-cublas: each is timed
    # on and off over the same runner (runner.graphs / the scratch's row threshold switched)
    cuda = device.type == "cuda"
    runner = ModelRunner(model, -(-(prompt_len + steps + 1) // PAGE_SIZE), "bf16" if cuda else "fp32", PAGE_SIZE,
                         prefill_cublas=True, cuda_graphs="on" if cuda else "off", static_decode=not cuda)
    pages = runner.pool.allocate(runner.pool.num_pages)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cut.vocab, (prompt_len,), generator=g).tolist()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def prefill(dense: bool) -> tuple[float, torch.Tensor]:
        if runner.dense_prefill is not None:
            runner.dense_prefill.min_rows = PREFILL_DENSE_ROWS if dense else 1 << 30
        runner.run([Work(prompt[:64], 0, pages)])  # warm-up (kernels compile)
        sync()
        t0 = time.perf_counter()
        logits = runner.run([Work(prompt, 0, pages)])[0]
        sync()
        return time.perf_counter() - t0, logits

    def decode(graphs) -> tuple[float, list[int]]:
        runner.graphs, token, tokens = graphs, first, []
        runner.run([Work([token], prompt_len, pages)])  # warm-up (a graph is captured at its first use)
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            token = int(runner.run([Work([token], prompt_len + i, pages)])[0][-1].argmax())
            tokens.append(token)
        sync()
        return (time.perf_counter() - t0) / steps, tokens

    prefill_s, _ = prefill(dense=False)
    dense_s, logits = prefill(dense=True)
    first = int(logits[-1].argmax())
    graphs = runner.graphs
    eager_s, eager_tokens = decode(None)
    decode_s, graph_tokens = decode(graphs) if graphs is not None else (eager_s, eager_tokens)
    kv_bytes = runner.kv.token_bytes * (prompt_len + steps / 2)
    bytes_per_token = model.weight_bytes() + kv_bytes
    roofline = copy_gbps * 1e9 / bytes_per_token
    result = {"format": fmt, "layers": layers, "of_layers": shape.layers, "weight_gib": model.weight_bytes() / GIB,
              "prefill_tokens": prompt_len, "prefill_tps": prompt_len / prefill_s,
              "prefill_cublas_tps": prompt_len / dense_s, "decode_tps": 1 / decode_s, "decode_eager_tps": 1 / eager_s,
              "decode_path": "CUDA graphs" if cuda else "static decode, no capture",
              "same_tokens": sum(a == b for a, b in zip(graph_tokens, eager_tokens)), "decode_steps": steps,
              "roofline_tps": roofline, "pct_roofline": 100 / decode_s / roofline}
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    del model, runner
    return result


# ---------------------------------------------------------------------------------------------------- report
def table(results: dict) -> str:
    lines = []
    env = results["environment"]
    lines.append(f"GPU check: {env.get('gpu', env['device'])} {env.get('capability', '')}, torch {env['torch']}, "
                 f"CUDA {env['cuda']}, Triton {env['triton']}")
    if "kernel_tests" in results:
        k = results["kernel_tests"]
        lines.append(f"kernel tests: {'pass' if k['returncode'] == 0 else 'FAIL'} ({k['summary']})")
    c = results["ceilings"]
    lines.append(f"ceilings: copy {c['copy_gbps']:.0f} GB/s, bf16 matmul {c['bf16_tflops']:.1f} TFLOP/s")
    lines.append("| GEMV | layer | shape | us | GB/s | % copy |")
    lines.append("|---|---|---|---|---|---|")
    for r in results["gemv"]:
        lines.append(f"| {r['format']} | {r['layer']} | {r['shape'][0]}x{r['shape'][1]} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {r['pct_copy']:.0f}% |")
    lines.append("| attention KV | context | KV MiB | us | GB/s | % copy |")
    lines.append("|---|---|---|---|---|---|")
    for r in results["attention"]:
        lines.append(f"| {r['format']} | {r['context']} | {r['kv_mib']:.2f} | {r['us']:.1f} | {r['gbps']:.0f} | "
                     f"{r['pct_copy']:.0f}% |")
    lines.append("| model | layers | weights GiB | prefill tok/s | cuBLAS prefill tok/s | decode tok/s (graphs) | "
                 "decode tok/s (eager) | same tokens | roofline tok/s | % roofline |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["end_to_end"]:
        lines.append(f"| {r['format']} | {r['layers']}/{r['of_layers']} | {r['weight_gib']:.2f} | "
                     f"{r['prefill_tps']:.0f} | {r['prefill_cublas_tps']:.0f} | {r['decode_tps']:.1f} | "
                     f"{r['decode_eager_tps']:.1f} | {r['same_tokens']}/{r['decode_steps']} | "
                     f"{r['roofline_tps']:.1f} | {r['pct_roofline']:.0f}% |")
    lines.extend(table_rows(results.get("hybrid", [])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--tiny", action="store_true", help="small shapes (seconds on a CPU)")
    p.add_argument("--memory-cap-gib", type=float, default=12.0)
    p.add_argument("--skip-tests", action="store_true", help="leave out the kernel tests")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but this PyTorch sees no CUDA GPU (torch.cuda.is_available() is False); "
              "check the driver (nvidia-smi) and that torch is a CUDA build.", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.tiny else Shape()
    ms = timer(device)
    results: dict = {"environment": environment(device), "tiny": args.tiny}
    if not args.skip_tests:
        results["kernel_tests"] = kernel_tests(device, args.out)
    results["ceilings"] = ceilings(device, args.tiny, ms)
    copy = results["ceilings"]["copy_gbps"]
    results["gemv"] = gemv(device, shape, ms, copy)
    results["attention"] = attention(device, shape, ms, args.tiny, copy)
    results["end_to_end"] = [end_to_end(device, shape, fmt, copy, args.memory_cap_gib, args.tiny)
                             for fmt in ("ternary", "int4_asym")]
    results["hybrid"] = [end_to_end_hybrid(device, TINY_HYBRID if args.tiny else HybridShape(), "ternary", copy,
                                           args.memory_cap_gib, args.tiny)]
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    failed = results.get("kernel_tests", {}).get("returncode", 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
