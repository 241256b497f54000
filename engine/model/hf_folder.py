"""Read Hugging Face model folders: config.json plus *.safetensors, memory-mapped."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.model.config import HF_ARCHS, LinearAttentionConfig, ModelConfig
from engine.model.weights import LoadedWeights, Progress, Ticker, check_complete


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no config.json.",
                             "Pass a GGUF file or a Hugging Face model folder (config.json + *.safetensors).")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} cannot be read: {e}.", "Download the model folder again.") from None
    archs = raw.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None and any("Moe" in a for a in archs):
        raise ModelLoadError(f"{folder.name}: {archs[0]} is a mixture-of-experts model; this engine does not run "
                             f"MoE layers yet.", f"Use a dense model of the family (supported: {', '.join(sorted(HF_ARCHS))}).")
    if arch is None:
        raise ModelLoadError(f"{folder.name}: architecture {archs or raw.get('model_type')} is not supported.",
                             f"Supported: {', '.join(sorted(HF_ARCHS))}.")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if rope_type in (None, "default") else dict(rope, rope_type=rope_type)
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return ModelConfig(
            arch=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            name=folder.name,
            layer_kinds=_layer_kinds(raw.get("layer_types")),
            linear=_linear_attention(raw),
            partial_rotary=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: field {e} is missing or malformed.", "Download the model folder again.") from None


# config.json "layer_types" -> engine layer kinds (engine/memory/specs.py). Sliding-window layers run as full
# attention, as before layer types were read (no model the registry supports uses a window).
LAYER_TYPES = {"full_attention": "attention", "sliding_attention": "attention", "linear_attention": "recurrent"}


def _linear_attention(raw: dict) -> LinearAttentionConfig | None:
    if "linear_num_value_heads" not in raw:
        return None
    return LinearAttentionConfig(int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                                 int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]),
                                 int(raw.get("linear_conv_kernel_dim", 4)))


def _layer_kinds(types) -> tuple[str, ...]:
    if not types:
        return ()
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ModelLoadError(f"config.json lists layer types {unknown} that this engine does not run.",
                             f"Supported layer types: {', '.join(LAYER_TYPES)}.")
    return tuple(LAYER_TYPES[t] for t in types)


def load_folder(folder: Path, progress: Progress | None = None,
                cancel: threading.Event | None = None) -> LoadedWeights:
    cfg = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors files.",
                             "Only safetensors weights are read; convert .bin checkpoints with transformers first.")
    handles = []
    try:
        for f in files:
            handles.append(safe_open(str(f), framework="pt", device="cpu"))
    except Exception as e:
        raise ModelLoadError(f"{folder}: a safetensors file cannot be opened ({e}).",
                             "The file is truncated or damaged; download it again.") from None
    names = [(h, k) for h in handles for k in h.keys()]
    ticker = Ticker(len(names), progress, cancel)
    tensors: dict[str, torch.Tensor] = {}
    storage: dict[str, str] = {}
    for handle, key in names:
        ticker.step(f"loading {key}")
        try:
            t = handle.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"{folder}: tensor {key} cannot be read ({e}).",
                                 "The file is truncated or damaged; download it again.") from None
        key = key.replace("model.language_model.", "model.", 1)  # a multimodal checkpoint's text model
        storage[key] = str(t.dtype).removeprefix("torch.")
        tensors[key] = t.float()
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    check_complete(cfg, tensors, folder.name)
    return LoadedWeights(cfg, tensors, "hf", storage)
