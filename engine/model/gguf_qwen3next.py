"""qwen3next GGUF files (Qwen3-Next-80B-A3B as llama.cpp's converter writes it), read as the qwen35 model class reads
a Qwen3NextForCausalLM folder: the grouped GDN input projections cut into the flat ones the model loads. The names
are in engine/model/gguf_names.py (LAYER_NAMES["qwen3next"]), the experts' in engine/model/gguf_experts.py.

Where each fact comes from (ggml-org/llama.cpp; no code copied):
- convert_hf_to_gguf.py, class Qwen3NextModel (a Qwen2MoeModel), modify_tensors:
  - `mtp.*` is dropped (no nextn blocks in these files);
  - A_log is stored as `ssm_a` = -exp(A_log); dt_bias is renamed dt_proj.bias (`ssm_dt.bias`); the conv kernel
    is squeezed to [conv_dim, K] (`ssm_conv1d`);
  - every `*norm.weight` but `linear_attn.norm` gets 1 added (input, post-attention, q/k and final norms; the
    GDN output norm `ssm_norm` is stored as it is);
  - `in_proj_qkvz` (HF: per key head [q | k | its value heads' v | their z]): the converter of commit a458664
    keeps it as it is, grouped, under SSM_IN (`ssm_in`); later ones (commit 0024aa74) split it into `attn_qkv`
    = [all q | all k | all v] and `attn_gate` = all z, each still in key-head order, so the value heads keep
    HF's grouped order (no tiling, unlike qwen35);
  - `in_proj_ba` (per key head [its value heads' b | their a]) is kept grouped in both, under SSM_BETA_ALPHA
    (`ssm_ba`); ssm_dt, ssm_a and ssm_out's columns keep HF's value-head order too;
  - the q/k norms, the attention layers' q_proj with its per-head [query | gate] rows, and the shared expert's gate
    ([1, H], ne {H, 1}) are written as HF holds them.
- convert_hf_to_gguf.py, Qwen2MoeModel.modify_tensors: experts stacked per projection (`ffn_{gate,up,down}_exps`;
  a fused gate_up_proj [E, 2I, H] split at I into gate and up); ModelBase.modify_tensors merges gate and up into
  `ffn_gate_up_exps` when asked (--fuse-gate-up-exps); ModelBase.prepare_tensors keeps 1-D tensors, norms,
  `ffn_gate_inp`, `ffn_gate_inp_shexp`, `ssm_conv1d` and `ssm_a` in F32 and squeezes nothing.
- convert_hf_to_gguf.py, TextModel.set_gguf_parameters / Qwen2MoeModel / Qwen3NextModel.set_gguf_parameters: the
  metadata: context/embedding/feed-forward lengths, head counts, key/value length (head_dim), rms eps, rope
  freq_base, expert_count, expert_used_count, expert_(shared_)feed_forward_length, ssm.conv_kernel, ssm.state_size
  (key head dim), ssm.group_count (key heads), ssm.time_step_rank (value heads), ssm.inner_size (value heads x
  value head dim), full_attention_interval (later converters only), rope.dimension_count = head_dim x
  partial_rotary_factor (0.25 by default).
- gguf-py/gguf/constants.py (MODEL_ARCH.QWEN3NEXT, TENSOR_NAMES, MODEL_TENSORS[QWEN3NEXT]) and tensor_mapping.py:
  the tensor names; `post_attention_layernorm` is ATTN_POST_NORM (`post_attention_norm`) for this architecture,
  which has no FFN_NORM and no dense ffn_gate/up/down (so every layer is a MoE layer).
- src/models/qwen3next.cpp, load_arch_hparams / load_arch_tensors: the layer kinds (`attention.recurrent_layers`,
  else full attention where (i + 1) % full_attention_interval == 0, default 4); `ssm_in` {H, 2 Kd + 2 Vd} optional
  beside `attn_qkv` {H, 2 Kd + Vd} + `attn_gate` {H, Vd}; `ssm_ba` {H, 2 HV}; `ffn_gate_inp` required in every
  layer (no expert: refused); `ffn_gate_inp_shexp` {H}.
- src/models/qwen3next.cpp, build_qkvz / build_layer_attn_linear: `ssm_in` is read as per key head [q | k | v | z]
  (widths Dk, Dk, HV/HK x Dv, HV/HK x Dv), `ssm_ba` as per key head [b | a] (HV/HK each), both flattened in key-head
  order; q and k are repeated so key head k serves value heads k HV/HK .. (k + 1) HV/HK - 1 (grouped, as HF's
  repeat_interleave); gate = softplus(a + ssm_dt) x ssm_a; the gated norm is ssm_norm's plain RMSNorm x silu(z).
- src/models/qwen3next.cpp, build_layer_ffn: build_moe_ffn with softmax gating and the top-k weights always
  renormalised (norm_w true: the file has no norm_topk_prob), plus the shared expert times sigmoid(ffn_gate_inp_shexp
  x). build_layer_attn: q/k norms per head, RoPE on n_rot = rope.dimension_count dims, output x sigmoid(gate)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernels.quant import from_gguf

ARCH = "qwen3next"
# the grouped tensors (HF names), the HF tensors each holds, and which of its per-key-head pieces each takes
_QKVZ, _BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
_PARTS = {_QKVZ: (("linear_attn.in_proj_qkv.weight", (0, 1, 2)), ("linear_attn.in_proj_z.weight", (3,))),
          _BA: (("linear_attn.in_proj_b.weight", (0,)), ("linear_attn.in_proj_a.weight", (1,)))}


def is_grouped(name: str) -> bool:
    return name.endswith((_QKVZ, _BA))


def _pieces(name: str, cfg) -> list[int]:
    """The widths of one key head's pieces of a grouped tensor: [q, k, v, z] or [b, a]."""
    n = cfg.linear
    per_key = n.num_v_heads // n.num_k_heads
    if name.endswith(_QKVZ):
        return [n.head_k_dim, n.head_k_dim, per_key * n.head_v_dim, per_key * n.head_v_dim]
    return [per_key, per_key]


def grouped_shape(name: str, cfg) -> tuple[int, int]:
    """The stored shape (rows, columns) of a grouped tensor of `cfg`."""
    return cfg.linear.num_k_heads * sum(_pieces(name, cfg)), cfg.hidden_size


def grouped_parts(name: str, cfg) -> list[tuple[str, np.ndarray]]:
    """The HF tensors a grouped tensor `name` holds, each with the stored rows it takes, in HF's order: in_proj_qkv
    is [all q | all k | all v] (key heads in order, each key head's value heads together), in_proj_z, in_proj_b and
    in_proj_a the value heads in that same grouped order."""
    widths = _pieces(name, cfg)
    starts = np.cumsum([0] + widths)
    heads = np.arange(cfg.linear.num_k_heads)[:, None] * starts[-1]

    def rows(piece: int) -> np.ndarray:  # that piece of every key head, key head by key head
        return (heads + np.arange(starts[piece], starts[piece + 1])[None, :]).reshape(-1)

    base = name[: -len(_QKVZ if name.endswith(_QKVZ) else _BA)]
    return [(base + part, np.concatenate([rows(p) for p in pieces])) for part, pieces in _PARTS[name[len(base):]]]


def split_grouped(t, parts: list[tuple[str, np.ndarray]], shape: tuple[int, int], native: bool,
                  native_types: tuple[str, ...], exact: Callable | None) -> dict[str, torch.Tensor]:
    """The HF tensors of grouped GGUF tensor `t` (stored `shape`), cut by whole rows: a Q4_0/Q4_1/Q8_0/TQ2_0 file's
    blocks repacked as stored where `native`, an exact low-bit form from `exact(values, blocks)` where it gives one,
    else float32."""
    kind = t.tensor_type.name
    out: dict[str, torch.Tensor] = {}
    if native and kind in native_types:
        raw = np.array(t.data, dtype=np.uint8, order="C").reshape(shape[0], -1)
        for hf, rows in parts:
            out[hf] = from_gguf(torch.from_numpy(np.ascontiguousarray(raw[rows])), kind, (len(rows), shape[1]))
        return out
    values = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(shape)
    blocks = np.asarray(t.data).reshape(shape[0], -1)
    for hf, rows in parts:
        packed = exact(values[rows], blocks[rows]) if exact is not None else None
        out[hf] = packed if packed is not None else torch.from_numpy(np.array(values[rows], dtype=np.float32))
    return out
