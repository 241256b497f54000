"""Read GGUF files with the `gguf` package: the llama family (Llama/SmolLM, Qwen2, Qwen3) and llama.cpp's qwen35
Gated-DeltaNet hybrids, dense or with mixture-of-experts MLPs (qwen35moe, qwen3next). The tensor names and stored
forms are in engine/model/gguf_names.py, the experts' in engine/model/gguf_experts.py, qwen3next's grouped GDN
projections in engine/model/gguf_qwen3next.py."""
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
from engine.model.config import (GGUF_ARCHS, GGUF_HYBRID_ARCHS, GGUF_MOE_ARCHS, LinearAttentionConfig, ModelConfig,
                                 MoEConfig)
from engine.model.gguf_experts import restore_moe, split_stacked
from engine.model.gguf_names import is_stacked, source_arch
from engine.model.gguf_names import column_heads, gguf_name, hf_name, restore, row_order, stored_shape, untile
from engine.model.gguf_qwen3next import grouped_parts, grouped_shape, is_grouped, split_grouped
from engine.model.gguf_exact import EXACT_LAYOUTS, STORED_AS, pack_exact, probe_planes
from engine.model.linear import TERNARY_GROUP, keeps_codes
from kernels.quant import QuantizedWeight, dequantize as dequantize_weight, from_gguf, quantize_ternary
from engine.model.weights import LoadedWeights, Progress, Ticker, check_complete, expected_shapes

log = logging.getLogger("ninfer.model")


class _Reader(GGUFReader):
    """gguf's reader, slicing its file as a plain array over the same memory map: a slice of np.memmap runs
    memmap's Python __array_finalize__, and the reader slices once per string of the vocabulary and the merges
    (~100K for a 49K vocabulary: 6 s of a 6.5 s open, now well under one)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None or plain.base is not self.data:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: Path) -> GGUFReader:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ModelLoadError(f"Cannot read model file {path}: {e.strerror}.", "Check the path and its permissions.")
    try:
        reader = _Reader(path)
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
    if arch == "qwen35" and experts:
        raise ModelLoadError(f"{path.name}: architecture 'qwen35' (dense Qwen3.5) claims {experts} experts; "
                             f"llama.cpp writes Qwen3.5-MoE files as 'qwen35moe'.",
                             "The file was converted wrongly; convert it again with llama.cpp's converter.")
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
    moe = _moe(arch, blocks - mtp, need) if arch in GGUF_MOE_ARCHS else None
    ffn = _field(reader, f"{arch}.feed_forward_length", 0 if moe is not None else None)
    if ffn is None:
        need("feed_forward_length")
    return ModelConfig(
        arch=MODEL_ARCH.get(arch, arch), vocab_size=int(vocab), hidden_size=hidden, num_layers=blocks - mtp,
        num_heads=heads, num_kv_heads=_one(_field(reader, f"{arch}.attention.head_count_kv", heads),
                                           f"{arch}.attention.head_count_kv", path),
        head_dim=head_dim,
        intermediate_size=_one(ffn, f"{arch}.feed_forward_length", path) if ffn else 0,
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch not in GGUF_HYBRID_ARCHS and "blk.0.attn_q_norm.weight" in names,  # (qwen35: its own q/k norms)
        name=str(_field(reader, "general.name", path.stem)),
        moe=moe,
        extra={"gguf_arch": arch},  # the stored forms follow the file's architecture (gguf_names.source_arch)
        **hybrid,
    )


# GGUF architectures that run as another one's model class: qwen35moe is qwen35 with MoE MLPs, qwen3next (Qwen3-Next:
# engine/model/gguf_qwen3next.py) is too
MODEL_ARCH = {"qwen35moe": "qwen35", "qwen3next": "qwen35"}


def _moe(arch: str, layers: int, need) -> MoEConfig:
    """llama.cpp's MoE keys; every layer is MoE, the top k always renormalised (llama.cpp hard-codes it, and a
    qwen3next file has no norm_topk_prob: src/models/qwen3next.cpp, build_layer_ffn)."""
    shared = int(need("expert_shared_feed_forward_length"))
    return MoEConfig(int(need("expert_count")), int(need("expert_used_count")),
                     int(need("expert_feed_forward_length")), shared, True, tuple(range(layers)))


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
    # M-RoPE's frequencies per (time, height, width) row: llama.cpp writes four, the fourth 0 for Qwen3.5
    sections = tuple(int(n) for n in (_field(reader, f"{arch}.rope.dimension_sections") or ())[:3])
    return {"layer_kinds": kinds, "linear": linear, "partial_rotary": rotated / head_dim,
            "mrope_section": sections if any(sections) else ()}


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    raise ModelLoadError(f"RoPE scaling '{kind}' in this GGUF file is not supported.",
                         "Supported: none, linear, and llama3 frequency factors (rope_freqs).")


NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "TQ2_0")  # repacked from their blocks (kernels.quant) when native=True
DENSE_TYPES = ("F32", "F16", "BF16", "F64")


def exact_native(values: np.ndarray, kind: str, blocks: np.ndarray, reorder) -> QuantizedWeight | None:
    """A linear weight of another low-bit type (engine.model.gguf_exact) in a format the kernels run, holding
    exactly the gguf package's decoding `values` (already reordered); None where no format does (it stays dense)."""
    dense = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if kind == "TQ1_0":  # ternary already: absmax scales hold it
        if dense.shape[1] % TERNARY_GROUP:
            return None
        qw = quantize_ternary(dense, TERNARY_GROUP, scale="absmax")
        return qw if torch.equal(dequantize_weight(qw), dense) else None
    if kind not in EXACT_LAYOUTS:
        return None
    scale, minimum = probe_planes(blocks, kind)
    plane = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(reorder(a)))  # noqa: E731
    return pack_exact(dense, plane(scale), plane(minimum), kind)


def _stored(t) -> str:
    return t.format.split("_")[0] if isinstance(t, QuantizedWeight) else "float32"


def _stacked_experts(t, name: str, shape: tuple[int, ...], native: bool, path: Path) -> dict:
    """One stacked expert tensor cut into its experts (engine/model/gguf_experts.py)."""
    if len(shape) != 3:
        raise ModelLoadError(f"{path.name}: tensor {t.name} has shape {shape}; stacked experts are 3-D "
                             f"(experts, rows, columns).", "The file is damaged or was converted wrongly; convert "
                                                           "it again.")
    exact = (lambda values, blocks: exact_native(values, t.tensor_type.name, blocks, lambda a: a)) if native else None
    try:
        return split_stacked(name, t, shape, native, NATIVE_TYPES, exact)
    except ValueError as e:
        raise ModelLoadError(f"{path.name}: tensor {t.name} ({t.tensor_type.name}) cannot be read: {e}.",
                             "The file is damaged; download it again.") from None


def _grouped(t, name: str, shape: tuple[int, ...], cfg: ModelConfig, native: bool, path: Path) -> dict:
    """qwen3next's grouped ssm_in / ssm_ba cut into the flat HF tensors (engine/model/gguf_qwen3next.py)."""
    want = grouped_shape(name, cfg)
    if shape != want:
        raise ModelLoadError(f"{path.name}: tensor {t.name} has shape {shape}, expected {want} (grouped per key "
                             f"head).", "The file is damaged or was converted wrongly; convert it again.")
    exact = (lambda values, blocks: exact_native(values, t.tensor_type.name, blocks, lambda a: a)) if native else None
    try:
        return split_grouped(t, grouped_parts(name, cfg), want, native, NATIVE_TYPES, exact)
    except ValueError as e:
        raise ModelLoadError(f"{path.name}: tensor {t.name} ({t.tensor_type.name}) cannot be read: {e}.",
                             "The file is damaged; download it again.") from None


def load_gguf(path: Path, progress: Progress | None = None, cancel: threading.Event | None = None,
              native: bool = False) -> LoadedWeights:
    """Tensors under HF names: dequantized to float32, or with native=True the linear weights of the low-bit types
    as kernels.quant.QuantizedWeight holding exactly what the file holds: Q4_0/Q4_1/Q8_0/TQ2_0 repacked from their
    blocks, the other types of engine.model.gguf_exact decoded and checked bit for bit; a weight no format holds
    exactly stays dense float32. `storage` says what each GGUF type became ("Q5_0 -> int8"), and so does the log."""
    reader = open_gguf(path)
    cfg = read_config(reader, path)
    tensors: dict[str, torch.Tensor] = {}
    storage: dict[str, str] = {}
    ticker = Ticker(len(reader.tensors), progress, cancel)
    expected = expected_shapes(cfg)
    main_layers = cfg.num_layers if cfg.arch in GGUF_HYBRID_ARCHS else None
    arch = source_arch(cfg)
    for t in reader.tensors:
        name = hf_name(t.name, arch, main_layers)
        ticker.step(f"loading {t.name}")
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        kind = storage[name] = t.tensor_type.name
        if is_stacked(name) or is_grouped(name):
            parts = _stacked_experts(t, name, shape, native, path) if is_stacked(name) else \
                _grouped(t, name, shape, cfg, native, path)
            tensors.update(parts)
            storage.pop(name)
            storage.update({n: f"{kind} -> {_stored(v)}" if native and kind not in DENSE_TYPES else kind
                            for n, v in parts.items()})
            continue
        # rows or V-head columns stored in another order than HF's (a tensor of the wrong shape is left as it is,
        # for check_complete to name it)
        want = stored_shape(name, cfg, expected.get(name))
        rows, cols = row_order(name, cfg, shape, want), column_heads(name, cfg, shape, want)
        block = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)][0]
        if native and keeps_codes(name) and kind in NATIVE_TYPES and len(shape) == 2 \
                and (cols is None or cols[2] % block == 0):
            raw = np.array(t.data, dtype=np.uint8, order="C").reshape(shape[0], -1)
            if rows is not None:  # whole rows move, so the packed blocks can be reordered as they are
                raw = raw[rows]
            if cols is not None:  # whole blocks of a head's columns move
                k_heads, v_heads, width = cols
                raw = raw.reshape(shape[0], shape[1] // block, -1)[:, untile(k_heads, v_heads, width // block)]
            storage[name] = f"{kind} -> {STORED_AS[kind]}"
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

        def reorder(a: np.ndarray) -> np.ndarray:
            a = a.reshape(shape)
            if rows is not None:
                a = a[rows]
            return a if cols is None else a[:, untile(*cols)]

        arr = reorder(arr)
        try:
            arr = restore_moe(name, restore(name, arr, cfg))
        except ValueError as e:
            raise ModelLoadError(f"{path.name}: tensor {t.name} cannot be read: {e}.",
                                 "The file is damaged or was converted wrongly; convert it again.") from None
        if native and kind not in DENSE_TYPES:
            exact = exact_native(arr, kind, np.asarray(t.data).reshape(shape[0], -1), reorder) \
                if keeps_codes(name) and len(shape) == 2 else None
            storage[name] = f"{kind} -> {STORED_AS[kind] if exact is not None else 'float32'}"
            if exact is not None:
                tensors[name] = exact
                continue
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # own copy: the file stays read-only
    converted = LoadedWeights(cfg, {}, "gguf", {n: k for n, k in storage.items() if " -> " in k}).storage_summary()
    if converted:
        log.info("%s: GGUF types as stored for the kernels (never fewer bits than the file): %s", path.name,
                 converted)
    check_complete(cfg, tensors, path.name, lambda n: gguf_name(n, arch))
    return LoadedWeights(cfg, tensors, "gguf", storage)
