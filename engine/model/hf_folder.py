"""Read Hugging Face model folders: config.json plus *.safetensors, memory-mapped."""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.model.config import (HF_ARCHS, HF_TEXT_CONFIG_ARCHS, VISION_PREFIX, LinearAttentionConfig, ModelConfig,
                                 MoEConfig)
from engine.model.weights import LoadedWeights, Progress, Ticker, check_complete

log = logging.getLogger("ninfer.model")


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
    other_moe = next((a for a in archs if "Moe" in a), None)
    if arch is None and other_moe:
        raise ModelLoadError(f"{folder.name}: {other_moe} is a mixture-of-experts model of a family this engine does "
                             f"not run.", f"Supported: {', '.join(sorted(HF_ARCHS))} (the MoE ones: Qwen3.5/3.6-MoE "
                                          f"and Qwen3-Next).")
    if arch is None:
        raise ModelLoadError(f"{folder.name}: architecture {archs or raw.get('model_type')} is not supported.",
                             f"Supported: {', '.join(sorted(HF_ARCHS))}.")
    if any(a in HF_TEXT_CONFIG_ARCHS for a in archs):
        raw = _text_config(raw, path)
    qwen35_moe = any(a in QWEN3_5_MOE for a in archs)
    if QWEN3_NEXT in archs:
        raw = {**QWEN3_NEXT_DEFAULTS, **raw}
    elif qwen35_moe:
        raw = {**QWEN3_5_MOE_DEFAULTS, **raw}
    elif arch == "qwen35":
        raw = {**QWEN3_5_DEFAULTS, **raw}
    moe = _moe(raw, path, every_layer=qwen35_moe) if QWEN3_NEXT in archs or qwen35_moe else None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # Multimodal RoPE (mrope_section): text positions are equal in its three streams (time, height, width), so
    # for text it is plain RoPE (transformers' Qwen3_5TextRotaryEmbedding with equal position ids).
    scaling = None if rope_type in (None, "default", "mrope") else dict(rope, rope_type=rope_type)
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return ModelConfig(
            arch=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"] if moe is None or raw.get("intermediate_size") or
                                  len(moe.layers) < int(raw["num_hidden_layers"]) else 0),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            name=folder.name,
            layer_kinds=_layer_kinds(raw.get("layer_types") or _interval_types(raw, arch)),
            linear=_linear_attention(raw),
            partial_rotary=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
            moe=moe,
            mrope_section=tuple(int(n) for n in rope.get("mrope_section") or ()),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: field {e} is missing or malformed.", "Download the model folder again.") from None


def _text_config(raw: dict, path: Path) -> dict:
    """A multimodal checkpoint's language model (Qwen3_5ForConditionalGeneration): the fields of "text_config".
    transformers ties the wrapper's lm_head to the embeddings by the top-level tie_word_embeddings (default false)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{path}: {raw['architectures'][0]} keeps its language model's fields under "
                             f"\"text_config\", which is missing or not an object.", "Download the model folder again.")
    return {**text, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))}


# config.json "layer_types" -> engine layer kinds (engine/memory/specs.py). Sliding-window layers run as full
# attention, as before layer types were read (no model the registry supports uses a window).
LAYER_TYPES = {"full_attention": "attention", "sliding_attention": "attention", "linear_attention": "recurrent"}


def _linear_attention(raw: dict) -> LinearAttentionConfig | None:
    if "linear_num_value_heads" not in raw:
        return None
    return LinearAttentionConfig(int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                                 int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]),
                                 int(raw.get("linear_conv_kernel_dim", 4)))


def _interval_types(raw: dict, arch: str) -> list[str] | None:
    """A hybrid config.json without layer_types: as transformers derives them, every full_attention_interval-th
    layer (default 4) is full attention."""
    if arch != "qwen35":
        return None
    interval = int(raw.get("full_attention_interval") or 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(int(raw["num_hidden_layers"]))]


# Qwen3-Next (Qwen3NextForCausalLM): transformers' defaults for the fields this engine reads, where config.json
# leaves them out; it runs as qwen35 once the grouped projections are split, its MoE layers as _moe says.
QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_NEXT_DEFAULTS = {"head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                       "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                       "partial_rotary_factor": 0.25, "num_experts": 512, "num_experts_per_tok": 10,
                       "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 32768}

# Qwen3.5 (Qwen3_5TextConfig, also inside Qwen3_5ForConditionalGeneration's text_config): transformers' defaults
QWEN3_5_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25, "max_position_embeddings": 32768}
# Qwen3.5/3.6-MoE (Qwen3_5MoeTextConfig): every layer's MLP is a mixture of experts, the top k always renormalised
QWEN3_5_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
QWEN3_5_MOE_DEFAULTS = QWEN3_5_DEFAULTS | {"num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                                           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}


def _moe(raw: dict, path: Path, every_layer: bool) -> MoEConfig | None:
    """The MoE layers as transformers builds them: every layer (Qwen3.5-MoE), or (Qwen3-Next) layer i when it is not
    in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0; the others have the dense MLP
    (intermediate_size). None when no layer is MoE."""
    try:
        layers = int(raw["num_hidden_layers"])
        experts = int(raw["num_experts"])
        if every_layer:
            moe, norm = list(range(layers)), True
        else:
            step = int(raw["decoder_sparse_step"])
            dense = {int(i) for i in raw["mlp_only_layers"] or []}
            moe = [i for i in range(layers) if i not in dense and experts > 0 and step > 0 and (i + 1) % step == 0]
            norm = bool(raw["norm_topk_prob"])
        if not moe:
            return None
        return MoEConfig(experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                         int(raw.get("shared_expert_intermediate_size") or 0), norm, tuple(moe))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: field {e} is missing or malformed.", "Download the model folder again.") from None


def _unfuse_experts(tensors: dict[str, torch.Tensor], storage: dict[str, str]) -> None:
    """Experts stored as 3-D tensors (the published Qwen3.5-MoE files: mlp.experts.gate_up_proj [E, 2I, H], gate
    rows first, and mlp.experts.down_proj [E, H, I]) into the per-expert names the model reads."""
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        t, kind = tensors.pop(name), storage.pop(name, "")
        base = name.rsplit(".", 1)[0]
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                gate, up = t[e].chunk(2, dim=0)
                parts = {"gate_proj": gate, "up_proj": up}
            else:
                parts = {"down_proj": t[e]}
            for proj, part in parts.items():
                key = f"{base}.{e}.{proj}.weight"
                tensors[key], storage[key] = part.contiguous(), kind


def _ungroup(cfg: ModelConfig, tensors: dict[str, torch.Tensor], storage: dict[str, str], where: str) -> None:
    """Qwen3-Next's grouped GDN input projections into the flat ones the model reads: in_proj_qkvz holds, per key
    head, [q | k | its value heads' v | their z] and in_proj_ba [their b | their a] (transformers'
    fix_query_key_value_ordering); in_proj_qkv is [all q | all k | all v], in_proj_z, in_proj_b, in_proj_a."""
    n, h = cfg.linear, cfg.hidden_size
    per_key = n.num_v_heads // n.num_k_heads
    qkvz = [n.head_k_dim, n.head_k_dim, per_key * n.head_v_dim, per_key * n.head_v_dim]
    for i, kind in enumerate(cfg.layer_kinds):
        a = f"model.layers.{i}.linear_attn."
        if kind != "recurrent" or a + "in_proj_qkvz.weight" not in tensors:
            continue
        for src, sizes in (("in_proj_qkvz.weight", qkvz), ("in_proj_ba.weight", [per_key, per_key])):
            w = tensors[a + src]
            if tuple(w.shape) != (n.num_k_heads * sum(sizes), h):
                raise ModelLoadError(f"{where}: {a + src} has shape {tuple(w.shape)}, expected "
                                     f"{(n.num_k_heads * sum(sizes), h)}.",
                                     "The file is incomplete or damaged; download it again.")
            parts = [p.reshape(-1, h) for p in w.view(n.num_k_heads, sum(sizes), h).split(sizes, dim=1)]
            del tensors[a + src]
            kept = storage.pop(a + src, "")
            names = (["in_proj_qkv.weight", "in_proj_z.weight"] if src.startswith("in_proj_qkvz")
                     else ["in_proj_b.weight", "in_proj_a.weight"])
            if len(parts) == 4:
                parts = [torch.cat(parts[:3]), parts[3]]
            for name, part in zip(names, parts):
                tensors[a + name], storage[a + name] = part.contiguous(), kept


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
    vision = [k for _, k in names if k.startswith(VISION_PREFIX)]
    if vision:  # the text model's weights only: engine/build.py loads the tower itself (engine/model/vision_input.py)
        names = [(h, k) for h, k in names if not k.startswith(VISION_PREFIX)]
        log.info("%s: the vision tower (%d tensors under %s*) is loaded apart from the text model "
                 "(engine/model/vision_input.py); without its image processor the engine serves text only",
                 folder.name, len(vision), VISION_PREFIX)
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
    if cfg.linear is not None:
        _ungroup(cfg, tensors, storage, folder.name)
    if cfg.moe is not None:
        _unfuse_experts(tensors, storage)
    check_complete(cfg, tensors, folder.name)
    return LoadedWeights(cfg, tensors, "hf", storage)
