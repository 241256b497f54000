"""Writes a seeded random Qwen3.5-MoE hybrid GGUF (architecture `qwen35moe`, laid out as llama.cpp's converter
writes one) with the default model's tokenizer: a mixture-of-experts model for `ninfer-bench --compare llama.cpp`
that needs no download.

    python scripts/make_moe_gguf.py /tmp/moe-1b-q8_0.gguf                 # ~1.0B total, ~0.2B active, Q8_0
    python scripts/make_moe_gguf.py /tmp/moe-1b-q4_0.gguf --type Q4_0     # the same weights in Q4_0
    ninfer-bench /tmp/moe-1b-q8_0.gguf --weight-dtype auto --compare llama.cpp

Default shape (every width a multiple of 32): hidden 1024, 16 layers in the 3 Gated-DeltaNet : 1 gated attention
pattern (`full_attention_interval` 4), GDN 4 key / 8 value heads x 128, attention 8 query / 2 KV heads x 128 (rope
on a quarter of each head), 64 routed experts of width 256 in every layer, top 8, one shared expert of width 256
with its sigmoid gate, untied output layer, the default model's vocabulary (49,152). That is 0.98B parameters, of
which a token reads 0.23B (the 8 picked experts of 64, everything else, the output layer; 0.18B without it).

`--type` (Q8_0 or Q4_0; F32 for exact comparisons) is the type of every linear weight: the stacked experts
(`ffn_{gate,up,down}_exps`), the shared expert, attention, GDN projections and the output layer. The router
(`ffn_gate_inp`) and the shared expert's gate (`ffn_gate_inp_shexp`) stay F32 as llama.cpp's converter and
llama-quantize keep them; norms, the GDN conv, A and dt bias F32; the token embedding Q8_0 (F32 with `--type F32`).

The weights are random, so its text is noise; what it measures is the speed of routing, reading and multiplying a
model of that shape and those types. They are drawn so that activations stay sane: linear weights normal with std
0.02, norms 1 + N(0, 0.1), GDN decay A uniform in [0.5, 16] (transformers' init range) and dt bias 1 + N(0, 0.3), and
routers with std `--router-spread` / sqrt(hidden), so router logits have a standard deviation of about
`--router-spread` (default 1.6): routing is far from uniform, its top-k weights unequal.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TYPES = ("Q8_0", "Q4_0", "F32")


@dataclass(frozen=True)
class MoEShape:
    hidden: int = 1024
    layers: int = 16
    heads: int = 8               # gated attention: query heads
    kv_heads: int = 2
    head_dim: int = 128
    gdn_k_heads: int = 4         # Gated-DeltaNet key (and query) heads
    gdn_v_heads: int = 8
    gdn_head_dim: int = 128      # key and value head dimension
    conv_kernel: int = 4
    experts: int = 64
    experts_used: int = 8
    expert_width: int = 256
    shared_width: int = 256
    interval: int = 4            # every fourth layer is gated attention
    context: int = 8192
    rope_theta: float = 1e7

    def check(self) -> None:
        widths = dict(hidden=self.hidden, head_dim=self.head_dim, gdn_head_dim=self.gdn_head_dim,
                      expert_width=self.expert_width, shared_width=self.shared_width)
        bad = [f"{k}={v}" for k, v in widths.items() if v % 32]
        if bad:
            raise ValueError(f"widths must be multiples of 32 (the Q8_0/Q4_0 block): {', '.join(bad)}")
        if self.head_dim % 8:
            raise ValueError("head_dim must be a multiple of 8 (rope on a quarter of it, in mrope sections)")
        if self.gdn_v_heads % self.gdn_k_heads or self.heads % self.kv_heads:
            raise ValueError("value heads must be a multiple of key heads, query heads of KV heads")
        if not 0 < self.experts_used <= self.experts:
            raise ValueError("experts_used must be in 1..experts")

    def is_attention(self, layer: int) -> bool:
        return (layer + 1) % self.interval == 0

    def params(self, vocab: int) -> tuple[int, int]:
        """(total, read by one token) parameter counts; the token's count holds the output layer, not the embedding
        table (one row of it is read)."""
        h, dk, dv = self.hidden, self.gdn_head_dim, self.gdn_head_dim
        qkv = 2 * self.gdn_k_heads * dk + self.gdn_v_heads * dv
        gdn = h * qkv + 2 * h * self.gdn_v_heads * dv + 2 * h * self.gdn_v_heads + qkv * self.conv_kernel
        attn = h * 2 * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim \
            + self.heads * self.head_dim * h
        expert, shared = 3 * h * self.expert_width, 3 * h * self.shared_width + h
        router = h * self.experts
        n_attn = sum(self.is_attention(i) for i in range(self.layers))
        mixers = n_attn * attn + (self.layers - n_attn) * gdn
        total = 2 * vocab * h + mixers + self.layers * (router + shared + self.experts * expert)
        active = vocab * h + mixers + self.layers * (router + shared + self.experts_used * expert)
        return total, active


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def write_moe_gguf(path: str | os.PathLike, shape: MoEShape = MoEShape(), qtype: str = "Q8_0", seed: int = 0,
                   router_spread: float = 1.6, tokenizer_gguf: str | None = None, header_only: bool = False) -> Path:
    """Writes the random qwen35moe model of `shape` to `path` with linear weights and experts in `qtype`; returns
    the path. The same seed and shape give the same float weights whatever `qtype` (each tensor drawn in order).
    `header_only`: the metadata and tensor table of that model with its data left a hole (a sparse file of the full
    size: what a model's ledger and fit marks read, for shapes far bigger than a test can write)."""
    import gguf
    from gguf import quants

    shape.check()
    if qtype not in TYPES:
        raise ValueError(f"qtype must be one of {', '.join(TYPES)}")
    bench = _sibling("make_bench_gguf")
    s, T = shape, gguf.GGMLQuantizationType
    linear_type = T[qtype]
    embed_type = T.F32 if qtype == "F32" else T.Q8_0
    rng = np.random.default_rng(seed)
    tok = gguf.GGUFReader(tokenizer_gguf or bench.default_tokenizer_gguf())
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    vocab = bench.copy_tokenizer(tok, w)

    w.add_name(f"random-qwen35moe-{s.hidden}x{s.layers}-{s.experts}e{s.experts_used}")
    w.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "F32": gguf.LlamaFileType.ALL_F32}[qtype])
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(s.rope_theta)
    rope_dim = s.head_dim // 4  # partial_rotary_factor 0.25, as Qwen3.5
    half = rope_dim // 2
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_dimension_sections([(half + 2) // 3, (half + 1) // 3, half // 3, 0])  # 64 -> [11, 11, 10, 0]
    w.add_vocab_size(vocab)
    w.add_ssm_conv_kernel(s.conv_kernel)
    w.add_ssm_state_size(s.gdn_head_dim)
    w.add_ssm_group_count(s.gdn_k_heads)
    w.add_ssm_time_step_rank(s.gdn_v_heads)
    w.add_ssm_inner_size(s.gdn_head_dim * s.gdn_v_heads)
    w.add_full_attention_interval(s.interval)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.experts_used)
    w.add_expert_feed_forward_length(s.expert_width)
    w.add_expert_shared_feed_forward_length(s.shared_width)

    def normal(*dims: int, std: float = 0.02) -> np.ndarray:
        if header_only:  # a shape without memory: only its size is written
            return np.broadcast_to(np.float32(0), dims)
        return rng.standard_normal(dims, dtype=np.float32) * np.float32(std)

    def add(name: str, arr: np.ndarray, qt=None) -> None:
        """`arr` in numpy order (ggml's ne reversed: the last axis is the row a block runs along)."""
        qt = T.F32 if qt is None else qt
        if header_only:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            w.add_tensor_info(name, arr.shape, np.float32, arr.size // block * size, raw_dtype=qt)
        elif qt == T.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(name, quants.quantize(arr, qt), raw_dtype=qt)

    def norm(name: str, n: int) -> None:
        add(name, 1 + normal(n, std=0.1))

    h = s.hidden
    add("token_embd.weight", normal(vocab, h), embed_type)
    for i in range(s.layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", h)
        norm(b + "post_attention_norm.weight", h)
        if s.is_attention(i):
            add(b + "attn_q.weight", normal(2 * s.heads * s.head_dim, h), linear_type)  # query and its gate
            add(b + "attn_k.weight", normal(s.kv_heads * s.head_dim, h), linear_type)
            add(b + "attn_v.weight", normal(s.kv_heads * s.head_dim, h), linear_type)
            add(b + "attn_output.weight", normal(h, s.heads * s.head_dim), linear_type)
            norm(b + "attn_q_norm.weight", s.head_dim)
            norm(b + "attn_k_norm.weight", s.head_dim)
        else:
            nk, nv, d = s.gdn_k_heads, s.gdn_v_heads, s.gdn_head_dim
            qkv = 2 * nk * d + nv * d
            add(b + "attn_qkv.weight", normal(qkv, h), linear_type)
            add(b + "attn_gate.weight", normal(nv * d, h), linear_type)
            add(b + "ssm_beta.weight", normal(nv, h), linear_type)
            add(b + "ssm_alpha.weight", normal(nv, h), linear_type)
            add(b + "ssm_conv1d.weight", normal(qkv, s.conv_kernel, std=0.2))
            add(b + "ssm_dt.bias", 1 + normal(nv, std=0.3))
            add(b + "ssm_a", -rng.uniform(0.5, 16.0, nv).astype(np.float32))  # the converter's -exp(A_log)
            norm(b + "ssm_norm.weight", d)
            add(b + "ssm_out.weight", normal(h, nv * d), linear_type)
        add(b + "ffn_gate_inp.weight", normal(s.experts, h, std=router_spread / math.sqrt(h)))  # router: F32
        add(b + "ffn_gate_exps.weight", normal(s.experts, s.expert_width, h), linear_type)  # ne {H, I, E}
        add(b + "ffn_up_exps.weight", normal(s.experts, s.expert_width, h), linear_type)
        add(b + "ffn_down_exps.weight", normal(s.experts, h, s.expert_width), linear_type)  # ne {I, H, E}
        add(b + "ffn_gate_shexp.weight", normal(s.shared_width, h), linear_type)
        add(b + "ffn_up_shexp.weight", normal(s.shared_width, h), linear_type)
        add(b + "ffn_down_shexp.weight", normal(h, s.shared_width), linear_type)
        add(b + "ffn_gate_inp_shexp.weight", normal(h))  # the shared expert's sigmoid gate: F32, ne {H}
    norm("output_norm.weight", h)
    add("output.weight", normal(vocab, h), linear_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if header_only:
        w.write_ti_data_to_file()
        data = sum(w.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values())
        start = w.ggml_pad(w.fout[0].tell(), w.data_alignment)
        w.close()
        os.truncate(path, start + data)
        return Path(path)
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--type", choices=TYPES, default="Q8_0", help="linear weights and experts (default Q8_0)")
    defaults = MoEShape()
    for field, value in asdict(defaults).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--router-spread", type=float, default=1.6, help="std of the router logits (default 1.6)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    shape = MoEShape(**{f: getattr(a, f) for f in asdict(defaults)})
    path = write_moe_gguf(a.out, shape, a.type, a.seed, a.router_spread)
    import gguf
    vocab = len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)
    total, active = shape.params(vocab)
    print(f"wrote {path}: {os.path.getsize(path) / 2**20:.0f} MiB, {total / 1e9:.3f}B parameters, "
          f"{active / 1e9:.3f}B read per token ({(active - vocab * shape.hidden) / 1e9:.3f}B without the output "
          f"layer)")


if __name__ == "__main__":
    main()
