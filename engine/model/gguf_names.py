"""GGUF tensor names and stored forms, as llama.cpp's converter writes them, mapped back to the HF names (and the HF
conventions) the model classes read. engine/model/gguf_file.py reads the files; this module says what each tensor is.

llama / qwen2 / qwen3: the names below; Llama q/k rows are permuted for interleaved RoPE (undone by `row_order`).

qwen35 (Qwen3.5 dense Gated-DeltaNet hybrids; the converter's Qwen3.5 text model, built on its Qwen3-Next one):
- every RMSNorm weight but the GDN output norm (`ssm_norm`) is stored with 1 added (the zero-centred (1 + w) folded
  in): input, post-attention, q/k, final and MTP norms. 1 is subtracted here, so the model sees HF's w;
- `ssm_a` = -exp(A_log) (no `.weight` suffix); `ssm_dt.bias` = dt_bias; `ssm_conv1d` is [conv_dim, K] (HF
  [conv_dim, 1, K]);
- where value heads outnumber key heads, the V heads are stored "tiled" ([k0 v0, k1 v0, ..., k0 v1, k1 v1, ...]) for
  ggml's broadcast, not grouped by key head as HF has them ([k0 v0, k0 v1, ..., k1 v0, ...]): the V rows of attn_qkv
  and of the conv kernel, the rows of attn_gate (z), ssm_beta, ssm_alpha, ssm_a and ssm_dt, and the input columns of
  ssm_out. `row_order` and `column_heads` bring them back to grouped order;
- q/k/v inside attn_qkv stay [q | k | v]; the attention layers' attn_q keeps HF's per-head [query | gate] rows;
- layer kinds: `{arch}.attention.recurrent_layers` when present, else layer i is full attention when
  (i + 1) % `{arch}.full_attention_interval` (default 4) == 0;
- qwen35moe (Qwen3.5/3.6-MoE) is qwen35 with mixture-of-experts MLPs (MOE_NAMES; engine/model/gguf_experts.py);
- qwen3next (Qwen3-Next) runs as qwen35 too, with its own stored forms (engine/model/gguf_qwen3next.py): the norms,
  ssm_a, ssm_dt and ssm_conv1d as qwen35, but the value heads in HF's grouped order (never tiled), and the GDN
  input projections grouped per key head (`ssm_in`, older converters; or `attn_qkv` + `attn_gate` flat) with
  `ssm_ba` grouped [b | a] per key head, cut here under the pseudo-names in_proj_qkvz / in_proj_ba;
- MTP: `{arch}.block_count` counts the `{arch}.nextn_predict_layers` MTP blocks appended after the main layers; the
  first holds blk.{L}.nextn.{eh_proj, enorm, hnorm, shared_head_norm} beside a full-attention layer's tensors. They
  load under the mtp.* names of HF checkpoints (engine/speculative/mtp.py)."""
from __future__ import annotations

import numpy as np

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
# qwen35: the post-attention norm under its own name, and the Gated-DeltaNet layers' tensors
_QWEN35_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# qwen35moe: the MoE MLPs' tensors, GGUF name (after "blk.N.") -> HF name (after "model.layers.N."); the stacked
# experts map to pseudo-names without ".weight", cut per expert by engine/model/gguf_experts.py
MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
}
STACKED = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj", "mlp.experts.gate_up_proj")


def is_stacked(name: str) -> bool:
    return name.endswith(STACKED)


def stacked_gguf_name(name: str) -> str | None:
    """For messages: `model.layers.N.mlp.experts.E.gate_proj.weight` -> `blk.N.ffn_gate_exps.weight[E]`."""
    parts = name.split(".")
    if len(parts) != 8 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"]:
        return None
    return f"blk.{parts[2]}.ffn_{parts[6].removesuffix('_proj')}_exps.weight[{parts[5]}]"


# qwen3next: no ssm_beta / ssm_alpha, the grouped ssm_in (HF's in_proj_qkvz) and ssm_ba (in_proj_ba) instead
_QWEN3NEXT_LAYER_NAMES = {k: v for k, v in _QWEN35_LAYER_NAMES.items() if k not in ("ssm_beta.weight",
                                                                                     "ssm_alpha.weight")} | {
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
}
LAYER_NAMES = {"llama": _LAYER_NAMES, "qwen2": _LAYER_NAMES, "qwen3": _LAYER_NAMES,
               "qwen35": _QWEN35_LAYER_NAMES | MOE_NAMES, "qwen35moe": _QWEN35_LAYER_NAMES | MOE_NAMES,
               "qwen3next": _QWEN3NEXT_LAYER_NAMES | MOE_NAMES}
# for messages: the qwen3next tensor an HF tensor cut from a grouped one comes from
_QWEN3NEXT_SOURCES = {"linear_attn.in_proj_b.weight": "ssm_ba.weight", "linear_attn.in_proj_a.weight": "ssm_ba.weight"}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}
# the first MTP block's own tensors (blk.{L}.nextn.*); nextn.embed_tokens (a copy of token_embd) is not read
NEXTN_NAMES = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight",
               "nextn.shared_head_head.weight": "mtp.lm_head.weight"}


def hf_name(gguf_name: str, arch: str = "llama", main_layers: int | None = None) -> str | None:
    """The HF name of a GGUF tensor (None: not read). Blocks from `main_layers` on are MTP blocks (mtp.*)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    if not gguf_name.startswith("blk."):
        return None
    _, idx, rest = gguf_name.split(".", 2)
    if not idx.isdecimal():
        return None
    names = LAYER_NAMES.get(arch, _LAYER_NAMES)
    if main_layers is not None and int(idx) >= main_layers:
        mtp = int(idx) - main_layers
        if rest in NEXTN_NAMES:
            return NEXTN_NAMES[rest] if mtp == 0 else None
        return f"mtp.layers.{mtp}.{names[rest]}" if rest in names else None
    return f"model.layers.{idx}.{names[rest]}" if rest in names else None


def gguf_name(name: str, arch: str) -> str | None:
    """The GGUF name of a main-model tensor the model reads (for messages): the inverse of hf_name."""
    for gguf, hf in GLOBAL_NAMES.items():
        if hf == name:
            return gguf
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        if arch == "qwen3next" and parts[3] in _QWEN3NEXT_SOURCES:
            return f"blk.{parts[2]}.{_QWEN3NEXT_SOURCES[parts[3]]}"
        for gguf, hf in LAYER_NAMES.get(arch, _LAYER_NAMES).items():
            if hf == parts[3]:
                return f"blk.{parts[2]}.{gguf}"
    return stacked_gguf_name(name)


def untile(num_k_heads: int, num_v_heads: int, width: int) -> np.ndarray:
    """Indices that bring `num_v_heads` blocks of `width` from llama.cpp's tiled order back to HF's order grouped by
    key head: grouped[i] = tiled[index[i]]."""
    per_key = num_v_heads // num_k_heads
    return np.arange(num_v_heads * width).reshape(per_key, num_k_heads, width).transpose(1, 0, 2).reshape(-1)


def source_arch(cfg) -> str:
    """The architecture a GGUF file names (its model class's, cfg.arch, may be another: qwen35moe -> qwen35)."""
    return cfg.extra.get("gguf_arch", cfg.arch)


def _tiled(cfg) -> bool:
    """V heads stored tiled: qwen35 / qwen35moe with more value than key heads (qwen3next keeps them grouped)."""
    n = cfg.linear
    return cfg.arch == "qwen35" and source_arch(cfg) != "qwen3next" and n is not None and n.num_v_heads != n.num_k_heads


def row_order(name: str, cfg, shape: tuple[int, ...], expected: tuple[int, ...] | None) -> np.ndarray | None:
    """The row permutation that restores HF's row order of a stored tensor (HF row i = stored row index[i]), or
    None. A tensor whose shape differs from the expected one is left as it is (check_complete names it)."""
    if shape != expected:
        return None
    if cfg.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        return np.arange(shape[0]).reshape(heads, shape[0] // heads // 2, 2).swapaxes(1, 2).reshape(-1)
    if not _tiled(cfg) or ".linear_attn." not in name:
        return None
    n = cfg.linear
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # [q | k | v]: only the V rows move
        return np.concatenate([np.arange(2 * n.key_dim), 2 * n.key_dim + untile(n.num_k_heads, n.num_v_heads,
                                                                                n.head_v_dim)])
    if name.endswith("in_proj_z.weight"):
        return untile(n.num_k_heads, n.num_v_heads, n.head_v_dim)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log")):
        return untile(n.num_k_heads, n.num_v_heads, 1)
    return None


def column_heads(name: str, cfg, shape: tuple[int, ...], expected: tuple[int, ...] | None):
    """(key heads, value heads, head width) where a stored tensor's input columns are tiled V heads (ssm_out);
    else None."""
    if shape != expected or not _tiled(cfg) or not name.endswith("linear_attn.out_proj.weight"):
        return None
    n = cfg.linear
    return n.num_k_heads, n.num_v_heads, n.head_v_dim


def stored_shape(name: str, cfg, expected: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The shape a tensor the model expects as `expected` has in a GGUF file of `cfg.arch`."""
    if cfg.arch == "qwen35" and expected is not None and name.endswith("linear_attn.conv1d.weight"):
        return expected[0], expected[2]
    return expected


def zero_centred(name: str) -> bool:
    """A qwen35 norm weight the converter stored as 1 + w (every norm but the GDN output norm)."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def restore(name: str, arr: np.ndarray, cfg) -> np.ndarray:
    """A dequantized tensor (rows already in HF order) in the HF convention: norms without the added 1, A_log from
    ssm_a, the conv kernel as [conv_dim, 1, K]. Raises ValueError where the stored values cannot be inverted."""
    if cfg.arch != "qwen35":
        return arr
    if name.endswith("linear_attn.A_log"):
        if not np.all(arr < 0):
            raise ValueError("ssm_a must hold -exp(A_log) < 0 for every value head")
        return np.log(-arr.astype(np.float64)).astype(np.float32)
    if zero_centred(name):
        return arr - np.float32(1.0)
    if name.endswith("linear_attn.conv1d.weight") and arr.ndim == 2:
        return arr[:, None, :]
    return arr
