"""A tiny seeded random Qwen3-Next MoE hybrid (transformers' Qwen3NextForCausalLM is the oracle) and the same weights
written as llama.cpp's converter writes a qwen3next GGUF (convert_hf_to_gguf.py, Qwen3NextModel over Qwen2MoeModel:
the facts are listed in engine/model/gguf_qwen3next.py). The writer does what the converter does to each tensor:
- A_log -> ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv1d [C, 1, K] squeezed to [C, K];
- every norm weight but linear_attn.norm + 1;
- in_proj_qkvz: `legacy` (the converter of commit a458664) keeps it grouped as ssm_in; otherwise (later converters)
  it is cut into attn_qkv = [all q | all k | all v] and attn_gate = all z, key head by key head (value heads stay
  grouped); in_proj_ba stays grouped as ssm_ba;
- the experts' fused gate_up_proj [E, 2I, H] split at I into ffn_gate_exps / ffn_up_exps (or kept together as
  ffn_gate_up_exps, the converter's --fuse-gate-up-exps), down_proj -> ffn_down_exps; the shared expert's gate kept
  [1, H];
- names from the gguf package's own map for MODEL_ARCH.QWEN3NEXT; 1-D tensors, norms, the router, the shared gate,
  the conv kernel and ssm_a F32, the other weights F32 or (q8_0) Q8_0 where a row holds whole blocks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.engine.qwen35_models import VOCAB, perturb, save_for_engine


def tiny_next_config(**overrides):
    """4 layers (3 GDN + 1 gated attention, full_attention_interval 4), hidden 64, 4 query / 2 KV heads x 32, GDN 2
    key / 4 value heads x 16, 7 experts (odd) of width 32, top 3, a shared expert of 48, every layer MoE."""
    from transformers import Qwen3NextConfig

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=7,
                  num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
                  tie_word_embeddings=False, layer_types=["linear_attention"] * 3 + ["full_attention"],
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen3NextConfig(**{**fields, **overrides})


@torch.no_grad()
def tiny_next_checkpoint(folder: Path, seed: int = 0, **overrides):
    """A seeded Qwen3NextForCausalLM (experts_implementation eager) with perturbed norms, A_log and dt_bias and
    routers and shared gates far from uniform, saved where build_engine loads it: (the transformers model, folder)."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3NextForCausalLM._from_config(tiny_next_config(**overrides), experts_implementation="eager").eval()
    perturb(hf)
    for name, p in hf.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
            p.normal_(0, 0.5)
    return hf, save_for_engine(hf, folder)


def _converted(name: str, t: torch.Tensor, cfg, legacy: bool, merged: bool) -> list[tuple[str, torch.Tensor]]:
    """One HF tensor as the converter turns it into (HF-style name for the name map, tensor) pairs."""
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t))]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", t)]
    if "conv1d" in name:
        return [(name, t.squeeze())]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, t + 1)]
    if name.endswith("in_proj_qkvz.weight") and not legacy:
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        per = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
        q, k, v, z = t.reshape(nk, -1, t.shape[-1]).split([dk, dk, per, per], dim=1)
        flat = [p.reshape(-1, t.shape[-1]) for p in (q, k, v, z)]
        return [("attn_qkv", torch.cat(flat[:3])), ("attn_gate", flat[3])]
    if name.endswith("mlp.experts.gate_up_proj"):
        if merged:
            return [("ffn_gate_up_exps", t)]
        inter = t.shape[-2] // 2
        return [(name.removesuffix("gate_up_proj") + "gate_proj.weight", t[:, :inter]),
                (name.removesuffix("gate_up_proj") + "up_proj.weight", t[:, inter:])]
    if name.endswith("mlp.experts.down_proj"):
        return [(name + ".weight", t)]
    return [(name, t)]


def _gguf_name(names, hf_name: str, layer: str | None) -> str:
    if hf_name in ("attn_qkv", "attn_gate", "ffn_gate_up_exps"):  # written by the converter under its own names
        return f"blk.{layer}.{hf_name}.weight"
    mapped = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, hf_name
    return mapped


def _metadata(w, cfg) -> None:
    """TextModel + Qwen2MoeModel + Qwen3NextModel.set_gguf_parameters."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    # the vocabulary (the converter's set_vocab: its length is the vocabulary size; the words do not matter here)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])


F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", "_norm.weight")


def write_next_gguf(hf, path: Path, *, legacy: bool = False, merged: bool = False, q8_0: bool = False,
                    interval: bool = True, skip: tuple[str, ...] = (), replace: dict | None = None) -> Path:
    """The model as a qwen3next GGUF laid out as llama.cpp's converter writes it (the module's docstring);
    `interval`: write full_attention_interval (the later converters do; the older left llama.cpp its default 4);
    `skip` / `replace`: GGUF tensors left out or replaced (F32 arrays)."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "qwen3next")
    w.add_name("tiny-qwen3next")
    _metadata(w, cfg)
    if interval:
        w.add_full_attention_interval(4)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, cfg.num_hidden_layers)
    for hf_name, t in hf.state_dict().items():
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        for name, part in _converted(hf_name, t.detach().float(), cfg, legacy, merged):
            gguf_name = _gguf_name(names, name, layer)
            if gguf_name in skip:
                continue
            arr = (replace or {}).get(gguf_name, part.contiguous().numpy())
            if q8_0 and arr.ndim >= 2 and arr.shape[-1] % 32 == 0 and not gguf_name.endswith(F32_ALWAYS):
                w.add_tensor(gguf_name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(gguf_name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
