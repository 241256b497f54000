"""Tiny random Qwen3.5-MoE hybrids for the tests (transformers' Qwen3_5MoeForCausalLM is the oracle), and the same
weights written as llama.cpp's converter writes a qwen35moe GGUF."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.engine.qwen35_models import VOCAB, perturb, save_for_engine


def tiny_moe_config(**overrides):
    """4 layers (3 GDN + 1 gated attention), hidden 64, 7 experts (odd) of width 32, top 3, a shared expert of 64."""
    from transformers import Qwen3_5MoeTextConfig

    fields = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=64, num_experts=7, num_experts_per_tok=3,
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    return Qwen3_5MoeTextConfig(**{**fields, **overrides})


@torch.no_grad()
def tiny_moe_checkpoint(folder: Path, seed: int = 0, **overrides):
    """A seeded transformers Qwen3_5MoeForCausalLM (experts_implementation eager) with perturbed norms, A_log and
    dt_bias, and routers and shared gates far from uniform (transformers' init routes nearly evenly, which hides a
    wrong top-k), saved where build_engine loads it: (the transformers model, the folder)."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3_5MoeForCausalLM._from_config(tiny_moe_config(**overrides), experts_implementation="eager").eval()
    perturb(hf)
    for name, p in hf.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
            p.normal_(0, 0.5)
    return hf, save_for_engine(hf, folder)


@torch.no_grad()
def tiny_qwen3_next_moe(folder: Path, norm_topk: bool):
    """A seeded Qwen3NextForCausalLM with 5 experts, top 2, and dense MLPs in layers 1 and 5 (mlp_only_layers),
    routers spread as tiny_moe_checkpoint's: (the transformers model, the folder)."""
    from transformers import Qwen3NextForCausalLM
    from tests.engine.test_qwen35_formats import qwen3_next_config

    torch.manual_seed(4)
    cfg = qwen3_next_config(num_experts=5, num_experts_per_tok=2, mlp_only_layers=[1, 5], norm_topk_prob=norm_topk)
    hf = Qwen3NextForCausalLM._from_config(cfg, experts_implementation="eager").eval()
    perturb(hf)
    for name, p in hf.named_parameters():
        if name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
            p.normal_(0, 0.5)
    return hf, save_for_engine(hf, folder)


def fused_state(hf) -> dict[str, torch.Tensor]:
    """The model's tensors as the published Qwen3.5-MoE files hold them: experts as 3-D gate_up_proj / down_proj,
    under the multimodal checkpoint's model.language_model. prefix."""
    return {n.replace("model.", "model.language_model.", 1): t.detach().contiguous()
            for n, t in hf.state_dict().items()}


def write_moe_gguf(hf, path: Path, *, q8_0: bool = False, merged: bool = False) -> Path:
    """The model as a qwen35moe GGUF, laid out as llama.cpp's converter writes it: GDN tensors as for qwen35
    (tests/engine/test_qwen35_formats.converted), the router F32, experts stacked per projection (gate and up
    separate, or `merged` as ffn_gate_up_exps), the shared gate {H}; `q8_0`: every expert and linear weight in Q8_0."""
    import gguf
    from tests.engine.test_qwen35_formats import converted

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    w.add_name("tiny-qwen35moe")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections([2, 1, 1, 0])
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(4)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, cfg.num_hidden_layers)
    for hf_name, t in _stacked(hf.state_dict(), cfg.moe_intermediate_size, merged).items():
        if hf_name.endswith(".dt_bias"):
            name = names.get_name(hf_name.removesuffix(".dt_bias") + ".dt_proj.bias", try_suffixes=(".bias",))
        else:
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            name = name + ".weight" if ".mlp.experts." in hf_name else name  # stacked experts: a parameter
        assert name is not None, hf_name
        arr = converted(hf_name, t.detach().float(), cfg).numpy()
        if hf_name.endswith("shared_expert_gate.weight"):
            arr = arr.reshape(-1)
        linear = arr.ndim >= 2 and arr.shape[-1] % 32 == 0 and "conv1d" not in name and "token_embd" not in name \
            and "ffn_gate_inp" not in name
        if q8_0 and linear:
            w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _stacked(state: dict[str, torch.Tensor], inter: int, merged: bool) -> dict[str, torch.Tensor]:
    """transformers' in-memory 3-D experts as the converter stacks them: gate_up_proj split into gate and up
    (unless `merged`)."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj") and not merged:
            base = name.removesuffix("gate_up_proj")
            out[base + "gate_proj"], out[base + "up_proj"] = t[:, :inter], t[:, inter:]
        else:
            out[name] = t
    return out
