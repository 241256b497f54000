"""Read llama-family GGUF files (Llama/SmolLM, Qwen2, Qwen3) with the `gguf` package."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.errors import ModelLoadError
from engine.model.config import GGUF_ARCHS, ModelConfig
from engine.model.linear import INT4_GROUP, TERNARY_GROUP, is_linear
from kernels.quant import from_gguf, quantize_int4, quantize_int8, quantize_ternary
from engine.model.weights import LoadedWeights, Progress, Ticker, check_complete, expected_shapes

log = logging.getLogger("ninfer.model")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
    return None


def open_gguf(path: Path) -> GGUFReader:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ModelLoadError(f"Cannot read model file {path}: {e.strerror}.", "Check the path and its permissions.")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError, struct/numpy errors on damaged files
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}).",
                             "The file is truncated or damaged; download it again.") from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{path}: tensor {t.name} lies outside the file (offset {t.data_offset}, "
                                 f"{t.n_bytes} bytes, file {size} bytes).",
                                 "The file is truncated or damaged; download it again.")
    return reader


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:
        return default


def read_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{path.name}: architecture '{arch}' is not supported.",
                             f"Supported GGUF architectures: {', '.join(GGUF_ARCHS)}.")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path.name}: GGUF metadata '{arch}.{key}' is missing.",
                                 "The file was converted by an incompatible tool; convert it again.")
        return value

    names = {t.name for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    return ModelConfig(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden, num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(need("feed_forward_length")),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        name=str(_field(reader, "general.name", path.stem)),
    )


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    raise ModelLoadError(f"RoPE scaling '{kind}' in this GGUF file is not supported.",
                         "Supported: none, linear, and llama3 frequency factors (rope_freqs).")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders Llama q/k rows for interleaved RoPE; restore HF's half-split order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "TQ2_0")  # kept as stored (kernels.quant) when native=True
# Other low-bit GGUF types of linear weights, with native=True: decoded by the gguf package, then stored in the
# nearest format the kernels run (said in the load log). TQ1_0 is ternary already (exact); a Q4_K sub-block is 32
# values on a 16-level grid, which an int4 group of 32 holds exactly where its codes span 0..15 (1.5% relative error
# on random blocks); 5- and 6-bit types lose more as int4 / int8 (per channel).
NEAREST_FORMAT = {"TQ1_0": "ternary", "Q2_K": "int4", "Q3_K": "int4", "Q4_K": "int4", "Q5_0": "int4",
                  "Q5_1": "int4", "Q5_K": "int4", "IQ4_NL": "int4", "IQ4_XS": "int4", "Q6_K": "int8", "Q8_1": "int8",
                  "Q8_K": "int8"}


def nearest_native(dense: torch.Tensor, gguf_type: str):
    """A linear weight decoded from `gguf_type` in the nearest format the kernels run (kernels.quant), or None
    where its shape does not fit that format's groups (it then stays dense)."""
    fmt = NEAREST_FORMAT[gguf_type]
    in_features = dense.shape[1]
    if fmt == "ternary" and in_features % TERNARY_GROUP == 0:
        return quantize_ternary(dense, TERNARY_GROUP, scale="absmax")
    if fmt == "int4" and in_features % INT4_GROUP == 0:
        return quantize_int4(dense, INT4_GROUP, symmetric=False)
    if fmt == "int8":
        return quantize_int8(dense)
    return None


def load_gguf(path: Path, progress: Progress | None = None, cancel: threading.Event | None = None,
              native: bool = False) -> LoadedWeights:
    """Tensors under HF names: dequantized to float32, or with native=True the linear weights stored as
    Q4_0/Q4_1/Q8_0/TQ2_0 kept in that format as kernels.quant.QuantizedWeight (no requantizing), and those of the
    other low-bit types (NEAREST_FORMAT) decoded and stored in the nearest format the kernels run."""
    reader = open_gguf(path)
    cfg = read_config(reader, path)
    tensors: dict[str, torch.Tensor] = {}
    storage: dict[str, str] = {}
    converted: dict[str, int] = {}  # GGUF type -> tensors stored in its NEAREST_FORMAT
    ticker = Ticker(len(reader.tensors), progress, cancel)
    expected = expected_shapes(cfg)
    for t in reader.tensors:
        name = hf_name(t.name)
        ticker.step(f"loading {t.name}")
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        storage[name] = t.tensor_type.name
        permute = cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")) and shape == expected.get(name)
        heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        if native and is_linear(name) and t.tensor_type.name in NATIVE_TYPES and len(shape) == 2:
            raw = np.array(t.data, dtype=np.uint8, order="C").reshape(shape[0], -1)
            if permute:  # whole rows move, so the packed blocks can be reordered as they are
                raw = np.ascontiguousarray(_unpermute(raw, heads))
            try:
                tensors[name] = from_gguf(torch.from_numpy(raw), t.tensor_type.name, shape)
            except ValueError as e:
                raise ModelLoadError(f"{path.name}: tensor {t.name} ({t.tensor_type.name}) cannot be read: {e}.",
                                     "The file is damaged; download it again.") from None
            continue
        try:
            arr = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(shape)
        except Exception as e:
            raise ModelLoadError(f"{path.name}: tensor {t.name} ({t.tensor_type.name}) cannot be decoded: {e}.",
                                 "The file is damaged or uses a quantization this version cannot read.") from None
        if permute:  # (a tensor of the wrong shape is left as it is, for check_complete to name it)
            arr = _unpermute(arr, heads)
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # own copy: the file stays read-only
        kind = t.tensor_type.name
        if native and is_linear(name) and kind in NEAREST_FORMAT and len(shape) == 2:
            nearest = nearest_native(tensors[name], kind)
            if nearest is not None:
                tensors[name] = nearest
                storage[name] = f"{kind} as {NEAREST_FORMAT[kind]}"
                converted[kind] = converted.get(kind, 0) + 1
    for kind, n in converted.items():
        log.info("%s: %d %s tensors decoded by the gguf package and stored as %s (the nearest format the kernels "
                 "run)", path.name, n, kind, NEAREST_FORMAT[kind])
    check_complete(cfg, tensors, path.name)
    return LoadedWeights(cfg, tensors, "gguf", storage)
