"""Qwen3.5-class Gated-DeltaNet hybrids (Qwen3_5ForCausalLM): linear-attention (GDN) layers with a recurrent state
(engine/model/gdn.py) and gated full-attention layers over the paged KV cache, as config.json's layer_types list
them (3 GDN : 1 attention in the published models).

Gated attention: q_proj gives each head [query | gate]; per-head zero-centred RMSNorm on q and k; RoPE on the first
`partial_rotary` share of each head's dims; attention; times sigmoid(gate); o_proj. Every RMSNorm of the model is
zero-centred (scale 1 + w), but the GDN output norm, which is plain: the (1 + w) is folded into the weights at load."""
from __future__ import annotations

import torch

from engine.memory.specs import AttentionSpec
from engine.batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.gdn import GDNLayer, gdn_shapes
from engine.model.layers import Rotary, paged_attention, rms_norm
from engine.model.linear import LOW_BIT, Linear, fuse
from engine.model.moe import GatedMLP, mlp_shapes
from engine.model.llama import LlamaModel
from engine.model.weights import LoadedWeights


def _zero_centred(name: str) -> bool:
    return name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                          "k_norm.weight")) or name == "model.norm.weight"


class GatedAttentionLayer(GatedMLP):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str):
        p = prefix + "self_attn."
        self.cfg = cfg
        self.input_norm, self.post_norm = w[prefix + "input_layernorm.weight"], w[prefix + "post_attention_layernorm.weight"]
        self.qkv = Linear(fuse([w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"]]))
        self.o = Linear(w[p + "o_proj.weight"])
        self.q_norm, self.k_norm = w[p + "q_norm.weight"], w[p + "k_norm.weight"]
        self.rotated = int(cfg.head_dim * cfg.partial_rotary)
        self.init_mlp(cfg, w, prefix)
        self.cache_spec = AttentionSpec(cfg.num_kv_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ordinal: int, batch: ForwardBatch,
                rotary: Rotary, rope_tables=None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        hd, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        residual = x if residual is None else residual + x
        h = rms_norm(residual, self.input_norm, cfg.rms_eps)
        qg, k, v = self.qkv(h).split([2 * hq * hd, hkv * hd, hkv * hd], dim=-1)
        qg = qg.view(-1, hq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(-1, hq * hd)
        q = rms_norm(q, self.q_norm, cfg.rms_eps)
        k = rms_norm(k.view(-1, hkv, hd), self.k_norm, cfg.rms_eps)
        qk = torch.cat((q, k), dim=1)
        r = self.rotated
        qk = torch.cat((rotary(qk[..., :r].contiguous(), batch.positions, batch.max_position, rope_tables),
                        qk[..., r:]), dim=-1)
        q, k = qk.split([hq, hkv], dim=1)
        attn = paged_attention(q.contiguous(), k.contiguous(), v.view(-1, hkv, hd), ordinal, batch, hd ** -0.5)
        x = self.o(attn.reshape(-1, hq * hd) * torch.sigmoid(gate))
        residual = residual + x
        h = rms_norm(residual, self.post_norm, cfg.rms_eps)
        return self.mlp(h), residual


class Qwen35Model(LlamaModel):
    def __init__(self, weights: LoadedWeights, dtype: torch.dtype, device: torch.device, weight_format: str = "",
                 keep_native: bool = False, cpu_compile: str = "auto", state_fp16: bool = False,
                 host_experts: int = 0):
        """`state_fp16` (--gdn-state-fp16): the delta-rule state is stored in fp16 (half the bytes); it is computed
        in fp32, and its read-out stays fp32 until the gated norm. `host_experts` (--n-cpu-moe): the routed experts
        of the first that many MoE layers stay in host memory and are computed on the CPU
        (engine/model/moe.py, in host_dtype); their router and shared expert stay with the model."""
        self.state_dtype = "float16" if state_fp16 else "float32"
        moe = weights.config.moe
        self.host_layers = frozenset(sorted(moe.layers)[:host_experts]) if moe is not None else frozenset()
        tensors = {n: (1.0 + t.float()) if _zero_centred(n) else t for n, t in weights.tensors.items()}
        super().__init__(LoadedWeights(weights.config, tensors, weights.source_format, weights.storage), dtype,
                         device, weight_format, keep_native, cpu_compile)
        cfg = self.cfg
        self.rotary = Rotary(int(cfg.head_dim * cfg.partial_rotary), cfg.rope_theta, cfg.rope_scaling, None, device)
        for i in self.host_layers:
            self.layers[i].moe.host, self.layers[i].moe.host_dtype = True, self.host_dtype

    def placement(self, name: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.device]:
        layer = name.split(".")[2] if name.startswith("model.layers.") and ".mlp.experts." in name else None
        if layer is not None and int(layer) in self.host_layers:
            return self.host_dtype, torch.device("cpu")
        return dtype, device

    @property
    def host_dtype(self) -> torch.dtype:
        """What host experts compute in: float32 beside low-bit weights (the CPU kernels take float32), else the
        model's dtype (a bf16 model's experts stay bf16 in host memory: half the bytes of float32)."""
        return torch.float32 if self.weight_format in LOW_BIT else self.dtype

    @classmethod
    def layer_shapes(cls, kind: str, cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
        h = cfg.hidden_size
        shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)} | mlp_shapes(cfg, p)
        if kind == "recurrent":
            return shapes | gdn_shapes(cfg, p)
        a, hd = p + "self_attn.", cfg.head_dim
        return shapes | {a + "q_proj.weight": (2 * cfg.num_heads * hd, h), a + "k_proj.weight": (cfg.kv_size, h),
                         a + "v_proj.weight": (cfg.kv_size, h), a + "o_proj.weight": (h, cfg.q_size),
                         a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}

    def make_layer(self, kind: str, cfg: ModelConfig, w: dict, prefix: str):
        if kind == "recurrent":
            return GDNLayer(cfg, w, prefix, str(self.dtype).removeprefix("torch."), self.state_dtype)
        return GatedAttentionLayer(cfg, w, prefix)

    # ---- MTP (engine/speculative/mtp.py): as vLLM's Qwen3.5 MTP, every norm of the block is zero-centred (1 + w),
    # and it reads the model's hidden state after the final norm and chains its own output after mtp.norm
    mtp_reads_normed_hidden = True

    def mtp_norm(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w.float()

    def mtp_layer(self, cfg: ModelConfig, w: dict[str, torch.Tensor]) -> GatedAttentionLayer:
        return GatedAttentionLayer(cfg, {n: (self.mtp_norm(t) if _zero_centred(n) else t).to(device=self.device,
                                                                                            dtype=self.dtype)
                                         for n, t in w.items()}, "")
