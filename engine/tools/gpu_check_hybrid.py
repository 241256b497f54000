"""scripts/gpu_check.sh's hybrid part: a synthetic Qwen3.5-27B-shaped Gated-DeltaNet hybrid (64 layers = 16 x (3
GDN + 1 gated attention), 24 query / 4 KV heads x 256, GDN 16 key / 48 value heads x 128, intermediate 17408) with
random low-bit weights built on the device, cut to the memory cap like the llama model of gpu_check.

It prefills in chunks to 4K and then 32K tokens and times decode at each depth (CUDA graphs where they run, and
eagerly), against the roofline: copy bandwidth / bytes a decode step moves (weights, the attention layers' KV, and
the recurrent state read and written). It reports the state bytes per sequence and KV bytes per token."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.memory.geometry import PAGE_SIZE
from engine.memory.state import SeqState
from engine.model.config import LinearAttentionConfig, ModelConfig
from engine.model.qwen35 import Qwen35Model
from engine.model.weights import LoadedWeights
from engine.runner import ModelRunner, Work
from engine.tools.synthetic import BITS, GIB, random_weight


@dataclass(frozen=True)
class HybridShape:
    layers: int = 64
    hidden: int = 5120
    heads: int = 24
    kv_heads: int = 4
    head_dim: int = 256
    intermediate: int = 17408
    vocab: int = 248320
    k_heads: int = 16
    v_heads: int = 48
    head_k: int = 128
    head_v: int = 128
    interval: int = 4  # every 4th layer is an attention layer

    def config(self, layers: int) -> ModelConfig:
        kinds = tuple("attention" if (i + 1) % self.interval == 0 else "recurrent" for i in range(layers))
        if "attention" not in kinds:
            kinds = kinds[:-1] + ("attention",)
        return ModelConfig(arch="qwen35", vocab_size=self.vocab, hidden_size=self.hidden, num_layers=layers,
                           num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate, max_position=65536, layer_kinds=kinds,
                           linear=LinearAttentionConfig(self.k_heads, self.v_heads, self.head_k, self.head_v),
                           partial_rotary=0.25, rope_theta=1e7, name="synthetic-qwen35")


TINY_HYBRID = HybridShape(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=512,
                          k_heads=2, v_heads=4, head_k=32, head_v=32)


def synthetic_hybrid(shape: HybridShape, layers: int, fmt: str, device: torch.device) -> Qwen35Model:
    """A Qwen35Model of `shape` cut to `layers`, its linear weights random `fmt` (bf16 on CUDA, fp32 on a CPU)."""
    cfg = shape.config(layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors = {}
    for name, dims in Qwen35Model.expected_shapes(cfg).items():
        if len(dims) == 2 and name != "model.embed_tokens.weight":
            tensors[name] = random_weight(fmt if name != "lm_head.weight" else "int8", *dims, device)
        elif name.endswith("A_log"):
            tensors[name] = torch.rand(dims, device=device).log()
        elif name.endswith("conv1d.weight"):
            tensors[name] = torch.randn(dims, device=device, dtype=dtype) * 0.3
        elif name == "model.embed_tokens.weight":
            tensors[name] = torch.randn(dims, device=device, dtype=dtype) * 0.02
        else:  # norms (zero-centred ones become 1 + w at load), dt_bias
            tensors[name] = torch.zeros(dims, device=device, dtype=dtype)
    model = Qwen35Model(LoadedWeights(cfg, tensors, "synthetic"), dtype, device, {"int4_asym": "int4"}.get(fmt, fmt))
    return model


def weight_gib(shape: HybridShape, fmt: str) -> float:
    cfg = shape.config(shape.layers)
    params = sum(d[0] * d[1] for n, d in Qwen35Model.expected_shapes(cfg).items() if len(d) == 2
                 and n not in ("model.embed_tokens.weight", "lm_head.weight"))
    return params * BITS[fmt] / 8 / GIB


def end_to_end_hybrid(device: torch.device, shape: HybridShape, fmt: str, copy_gbps: float, cap_gib: float,
                      tiny: bool) -> dict:
    cuda = device.type == "cuda"
    per_layer = weight_gib(shape, fmt) * GIB / shape.layers
    budget = cap_gib * GIB * 0.7 - shape.vocab * shape.hidden * 3
    layers = max(shape.interval, min(shape.layers, int(budget // per_layer))) if cuda else shape.layers
    layers -= layers % shape.interval  # whole groups of 3 GDN + 1 attention
    depths, chunk, steps = ((128, 256), 64, 4) if tiny else ((4096, 32768), 4096, 16)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(device)
                                                       .total_memory), device)
        torch.cuda.reset_peak_memory_stats(device)
    model = synthetic_hybrid(shape, layers, fmt, device)
    runner = ModelRunner(model, -(-(depths[-1] + 2 * steps + 2) // PAGE_SIZE), "bf16" if cuda else "fp32", PAGE_SIZE,
                         cuda_graphs="on" if cuda else "off", static_decode=not cuda, state_slots=1, max_batch=1)
    pages, state = runner.pool.allocate(runner.pool.num_pages), SeqState(runner.state.allocate())
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape.vocab, (depths[-1],), generator=g).tolist()

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    rows, done, prefill_s = [], 0, 0.0
    graphs = runner.graphs
    for depth in depths:
        sync()
        t0 = time.perf_counter()
        while done < depth:
            n = min(chunk, depth - done)
            logits = runner.run([Work(prompt[done:done + n], done, pages, "last", state)])[0]
            done += n
        sync()
        prefill_s += time.perf_counter() - t0
        token = int(logits[-1].argmax())
        row = {"context": depth}
        for name, path in (("eager", None), ("graphs", graphs)):
            runner.graphs = path
            checkpoint = runner.state.read([state.slot])
            runner.run([Work([token], depth, pages, "last", state)])  # warm-up (a graph is captured at first use)
            runner.state.write([state.slot], checkpoint)
            sync()
            t0 = time.perf_counter()
            t, out = token, []
            for i in range(steps):
                t = int(runner.run([Work([t], depth + i, pages, "last", state)])[0][-1].argmax())
                out.append(t)
            sync()
            row[f"decode_{name}_tps"] = steps / (time.perf_counter() - t0)
            row[f"tokens_{name}"] = out
            runner.state.write([state.slot], checkpoint)  # both paths decode from the same state
        row["same_tokens"] = sum(a == b for a, b in zip(row.pop("tokens_eager"), row.pop("tokens_graphs")))
        kv_read = runner.kv.token_bytes * (depth + steps / 2)
        state_rw = 2 * runner.state.slot_bytes
        row["bytes_per_token"] = model.weight_bytes() + kv_read + state_rw
        row["roofline_tps"] = copy_gbps * 1e9 / row["bytes_per_token"]
        best = max(row["decode_eager_tps"], row["decode_graphs_tps"])
        row["pct_roofline"] = 100 * best / row["roofline_tps"]
        rows.append(row)
    runner.graphs = graphs
    result = {"format": fmt, "layers": layers, "of_layers": shape.layers, "weight_gib": model.weight_bytes() / GIB,
              "prefill_tokens": depths[-1], "prefill_tps": depths[-1] / prefill_s, "decode_steps": steps,
              "decode_path": "CUDA graphs" if cuda else "static decode, no capture",
              "state_mib_per_sequence": runner.state.slot_bytes / 2**20,
              "kv_bytes_per_token": runner.kv.token_bytes, "depths": rows}
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    del model, runner
    return result


def table_rows(results: list[dict]) -> list[str]:
    lines = ["| hybrid | layers | weights GiB | state MiB/seq | KV B/token | prefill tok/s | context | decode tok/s "
             "(graphs) | decode tok/s (eager) | same tokens | roofline tok/s | % roofline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for d in r["depths"]:
            lines.append(f"| {r['format']} | {r['layers']}/{r['of_layers']} | {r['weight_gib']:.2f} | "
                         f"{r['state_mib_per_sequence']:.1f} | {r['kv_bytes_per_token']} | {r['prefill_tps']:.0f} | "
                         f"{d['context']} | {d['decode_graphs_tps']:.1f} | {d['decode_eager_tps']:.1f} | "
                         f"{d['same_tokens']}/{r['decode_steps']} | {d['roofline_tps']:.1f} | "
                         f"{d['pct_roofline']:.0f}% |")
    return lines
