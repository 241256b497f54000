"""Read GGUF files with the `gguf` package: the llama family (Llama/SmolLM, Qwen2, Qwen3) and llama.cpp's qwen35
Gated-DeltaNet hybrids. The tensor names and stored forms are in engine/model/gguf_names.py."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.errors import ModelLoadError
from engine.model.config import GGUF_ARCHS, GGUF_HYBRID_ARCHS, GGUF_MOE_ARCHS, LinearAttentionConfig, ModelConfig
from engine.model.gguf_names import column_heads, gguf_name, hf_name, restore, row_order, stored_shape, untile
from engine.model.linear import INT4_GROUP, TERNARY_GROUP, is_linear
from kernels.quant import from_gguf, quantize_int4, quantize_int8, quantize_ternary
from engine.model.weights import LoadedWeights, Progress, Ticker, check_complete, expected_shapes

log = logging.getLogger("ninfer.model")


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
    experts = _field(reader, f"{arch}.expert_count")
    if arch in GGUF_MOE_ARCHS or (arch in GGUF_HYBRID_ARCHS and experts):
        family = GGUF_MOE_ARCHS.get(arch, arch)
        raise ModelLoadError(f"{path.name}: architecture '{arch}' ({family}, {experts or 'with'} experts) is a "
                             f"mixture-of-experts model; this engine does not run MoE layers yet.",
                             "Use a dense Gated-DeltaNet hybrid instead: a Qwen3.5 dense GGUF (architecture qwen35) "
                             "or Hugging Face folder (Qwen3_5ForCausalLM).")
    if arch not in GGUF_ARCHS + GGUF_HYBRID_ARCHS:
        raise ModelLoadError(f"{path.name}: architecture '{arch}' is not supported.",
                             f"Supported GGUF architectures: {', '.join(GGUF_ARCHS + GGUF_HYBRID_ARCHS)}.")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path.name}: GGUF metadata '{arch}.{key}' is missing.",
                                 "The file was converted by an incompatible tool; convert it again.")
        return value

    names = {t.name for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), _one(need("attention.head_count"), f"{arch}.attention.head_count", path)
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    blocks = int(need("block_count"))
    mtp = int(_field(reader, f"{arch}.nextn_predict_layers", 0) or 0) if arch in GGUF_HYBRID_ARCHS else 0
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    hybrid = _hybrid(reader, arch, path, blocks - mtp, head_dim, need) if arch in GGUF_HYBRID_ARCHS else {}
    return ModelConfig(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden, num_layers=blocks - mtp,
        num_heads=heads, num_kv_heads=_one(_field(reader, f"{arch}.attention.head_count_kv", heads),
                                           f"{arch}.attention.head_count_kv", path),
        head_dim=head_dim,
        intermediate_size=_one(need("feed_forward_length"), f"{arch}.feed_forward_length", path),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch not in GGUF_HYBRID_ARCHS and "blk.0.attn_q_norm.weight" in names,  # (qwen35: its own q/k norms)
        name=str(_field(reader, "general.name", path.stem)),
        **hybrid,
    )


def _one(value, key: str, path: Path) -> int:
    """A per-model count that llama.cpp may write per layer (0 on the layers without it): its one nonzero value."""
    if not isinstance(value, (list, tuple)):
        return int(value)
    nonzero = {int(v) for v in value if int(v)}
    if len(nonzero) != 1:
        raise ModelLoadError(f"{path.name}: GGUF metadata '{key}' varies per layer ({list(value)}); this engine "
                             f"needs one value for every layer.", "Use a model whose layers share one shape.")
    return nonzero.pop()


def _hybrid(reader: GGUFReader, arch: str, path: Path, layers: int, head_dim: int, need) -> dict:
    """The Gated-DeltaNet fields of a qwen35 file: layer kinds, the linear-attention shape, the rotated share."""
    if layers <= 0:
        raise ModelLoadError(f"{path.name}: {arch}.block_count leaves no layers beside the "
                             f"{arch}.nextn_predict_layers MTP layers.", "The file is damaged; convert it again.")
    recurrent = _field(reader, f"{arch}.attention.recurrent_layers")
    if recurrent is not None:
        kinds = tuple("recurrent" if r else "attention" for r in list(recurrent)[:layers])
    else:
        interval = int(_field(reader, f"{arch}.full_attention_interval", 4) or 4)
        kinds = tuple("attention" if (i + 1) % interval == 0 else "recurrent" for i in range(layers))
    k_heads, v_heads = int(need("ssm.group_count")), int(need("ssm.time_step_rank"))
    inner = int(need("ssm.inner_size"))
    if v_heads <= 0 or inner % v_heads:
        raise ModelLoadError(f"{path.name}: {arch}.ssm.inner_size={inner} is not a multiple of "
                             f"{arch}.ssm.time_step_rank={v_heads} (the value heads).",
                             "The file is damaged or was converted wrongly; convert it again.")
    linear = LinearAttentionConfig(k_heads, v_heads, int(need("ssm.state_size")), inner // v_heads,
                                   int(need("ssm.conv_kernel")))
    rotated = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    return {"layer_kinds": kinds, "linear": linear, "partial_rotary": rotated / head_dim}


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    raise ModelLoadError(f"RoPE scaling '{kind}' in this GGUF file is not supported.",
                         "Supported: none, linear, and llama3 frequency factors (rope_freqs).")


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
    main_layers = cfg.num_layers if cfg.arch in GGUF_HYBRID_ARCHS else None
    for t in reader.tensors:
        name = hf_name(t.name, cfg.arch, main_layers)
        ticker.step(f"loading {t.name}")
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        kind = storage[name] = t.tensor_type.name
        # rows or V-head columns stored in another order than HF's (a tensor of the wrong shape is left as it is,
        # for check_complete to name it)
        want = stored_shape(name, cfg, expected.get(name))
        rows, cols = row_order(name, cfg, shape, want), column_heads(name, cfg, shape, want)
        block = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)][0]
        if native and is_linear(name) and kind in NATIVE_TYPES and len(shape) == 2 \
                and (cols is None or cols[2] % block == 0):
            raw = np.array(t.data, dtype=np.uint8, order="C").reshape(shape[0], -1)
            if rows is not None:  # whole rows move, so the packed blocks can be reordered as they are
                raw = raw[rows]
            if cols is not None:  # whole blocks of a head's columns move
                k_heads, v_heads, width = cols
                raw = raw.reshape(shape[0], shape[1] // block, -1)[:, untile(k_heads, v_heads, width // block)]
            try:
                tensors[name] = from_gguf(torch.from_numpy(np.ascontiguousarray(raw).reshape(shape[0], -1)),
                                          kind, shape)
            except ValueError as e:
                raise ModelLoadError(f"{path.name}: tensor {t.name} ({kind}) cannot be read: {e}.",
                                     "The file is damaged; download it again.") from None
            continue
        try:
            arr = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(shape)
        except Exception as e:
            raise ModelLoadError(f"{path.name}: tensor {t.name} ({kind}) cannot be decoded: {e}.",
                                 "The file is damaged or uses a quantization this version cannot read.") from None
        if rows is not None:
            arr = arr[rows]
        if cols is not None:
            arr = arr[:, untile(*cols)]
        try:
            arr = restore(name, arr, cfg)
        except ValueError as e:
            raise ModelLoadError(f"{path.name}: tensor {t.name} cannot be read: {e}.",
                                 "The file is damaged or was converted wrongly; convert it again.") from None
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # own copy: the file stays read-only
        if native and is_linear(name) and kind in NEAREST_FORMAT and len(shape) == 2:
            nearest = nearest_native(tensors[name], kind)
            if nearest is not None:
                tensors[name] = nearest
                storage[name] = f"{kind} as {NEAREST_FORMAT[kind]}"
                converted[kind] = converted.get(kind, 0) + 1
    for kind, n in converted.items():
        log.info("%s: %d %s tensors decoded by the gguf package and stored as %s (the nearest format the kernels "
                 "run)", path.name, n, kind, NEAREST_FORMAT[kind])
    check_complete(cfg, tensors, path.name, lambda n: gguf_name(n, cfg.arch))
    return LoadedWeights(cfg, tensors, "gguf", storage)
