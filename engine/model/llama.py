"""The llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) computing over our paged KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.layers import Rotary, paged_attention, rms_norm, silu_and_mul
from engine.model.weights import LoadedWeights


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str):
        def get(name):
            return w.get(prefix + name)

        self.cfg = cfg
        self.input_norm = get("input_layernorm.weight")
        self.post_norm = get("post_attention_layernorm.weight")
        self.qkv = torch.cat([get(f"self_attn.{n}_proj.weight") for n in "qkv"])
        biases = [get(f"self_attn.{n}_proj.bias") for n in "qkv"]
        self.qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        self.o = get("self_attn.o_proj.weight")
        self.o_bias = get("self_attn.o_proj.bias")
        self.q_norm = get("self_attn.q_norm.weight")
        self.k_norm = get("self_attn.k_norm.weight")
        self.gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        self.down = get("mlp.down_proj.weight")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, layer: int, batch: ForwardBatch,
                rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        residual = x if residual is None else residual + x
        h = rms_norm(residual, self.input_norm, cfg.rms_eps)
        qkv = F.linear(h, self.qkv, self.qkv_bias)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_eps)
        q = rotary(q, batch.positions, batch.max_position)
        k = rotary(k, batch.positions, batch.max_position)
        attn = paged_attention(q, k, v, layer, batch, cfg.head_dim ** -0.5)
        x = F.linear(attn.view(-1, cfg.q_size), self.o, self.o_bias)
        residual = residual + x
        h = rms_norm(residual, self.post_norm, cfg.rms_eps)
        return F.linear(silu_and_mul(F.linear(h, self.gate_up)), self.down), residual


class LlamaModel:
    def __init__(self, weights: LoadedWeights, dtype: torch.dtype, device: torch.device):
        cfg = self.cfg = weights.config
        w = {name: t.to(device=device, dtype=dtype) for name, t in weights.tensors.items() if name != "rope_freqs"}
        self.dtype, self.device = dtype, device
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}.") for i in range(cfg.num_layers)]
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, weights.tensors.get("rope_freqs"),
                             device)

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for t in [self.embed, self.lm_head, self.norm] + [v for layer in self.layers for v in vars(layer).values()]:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [rows, vocab] (float32) for batch.logit_rows, or for every token when it is None."""
        x = F.embedding(batch.input_ids, self.embed)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer.forward(x, residual, i, batch, self.rotary)
        x = residual + x
        if batch.logit_rows is not None:
            x = x.index_select(0, batch.logit_rows)
        return F.linear(rms_norm(x, self.norm, self.cfg.rms_eps), self.lm_head).float()
