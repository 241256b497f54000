"""The shape of a model: everything the forward pass needs to know, read from GGUF metadata or config.json."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ModelLoadError
from engine.memory.specs import LAYER_KINDS
from engine.model.registry import check_supported

# The architectures (engine.model.registry) whose GGUF files engine/model/gguf_file.py reads: the llama family, and
# the Gated-DeltaNet hybrids (llama.cpp's qwen35: Qwen3.5 dense; qwen35moe; qwen3next).
GGUF_ARCHS = ("llama", "qwen2", "qwen3")
GGUF_HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# The mixture-of-experts GGUF architectures (llama.cpp writes them only with MoE layers, in every layer): both run
# as the qwen35 model class with MoE MLPs (engine/model/moe.py); qwen3next's grouped ssm_in / ssm_ba projections are
# cut as engine/model/gguf_qwen3next.py says.
GGUF_MOE_ARCHS = {"qwen35moe": "Qwen3.5-MoE", "qwen3next": "Qwen3-Next"}
# The names HF config.json files give the architectures engine.model.registry implements.
HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3NextForCausalLM": "qwen35",  # dense and MoE layers (mlp_only_layers, decoder_sparse_step); grouped projections
    "Qwen3_5ForConditionalGeneration": "qwen35",  # the published Qwen3.5 checkpoints: text model + vision tower
    "Qwen3_5MoeForCausalLM": "qwen35",  # Qwen3.5-MoE: every layer's MLP is a mixture of experts
    "Qwen3_5MoeForConditionalGeneration": "qwen35",  # the published Qwen3.5/3.6-MoE checkpoints (+ vision tower)
}
# Multimodal wrappers whose config.json nests the language model's fields under "text_config" and whose weights
# hold the text model under "model.language_model." beside a vision tower ("model.visual."), loaded apart by
# engine/model/vision_input.py (VisionModel.from_folder).
HF_TEXT_CONFIG_ARCHS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
VISION_PREFIX = "model.visual."


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated-DeltaNet layers of a hybrid (config.json linear_*): key heads serve value heads in groups."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLPs of a model (engine/model/moe.py): `layers` (their indices) replace the dense MLP
    with a router over `num_experts` SwiGLU experts of width `expert_size`, of which `top_k` run per token, their
    softmax weights renormalised over the k when `norm_topk` (Qwen3.5-MoE and llama.cpp: always), plus a shared
    expert of width `shared_size` (0: none) scaled by a sigmoid gate."""
    num_experts: int
    top_k: int
    expert_size: int
    shared_size: int
    norm_topk: bool = True
    layers: tuple[int, ...] = ()

    def problems(self, num_layers: int) -> list[str]:
        out = []
        if self.num_experts <= 0 or not 0 < self.top_k <= self.num_experts:
            out.append(f"num_experts={self.num_experts} and num_experts_per_tok={self.top_k} must satisfy "
                       f"0 < num_experts_per_tok <= num_experts")
        if self.expert_size <= 0 or self.shared_size < 0:
            out.append(f"moe_intermediate_size={self.expert_size} must be positive and "
                       f"shared_expert_intermediate_size={self.shared_size} not negative")
        if any(not 0 <= i < num_layers for i in self.layers):
            out.append(f"MoE layers {list(self.layers)} must lie in 0..{num_layers - 1}")
        return out


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLPs' width (0 where every layer is a mixture of experts)
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    name: str = ""
    layer_kinds: tuple[str, ...] = ()  # per layer: "attention" or "recurrent" (engine/memory/specs.py); () = all attention
    linear: LinearAttentionConfig | None = None  # the recurrent (Gated-DeltaNet) layers' shape, for hybrids
    partial_rotary: float = 1.0  # the share of each head's dims RoPE rotates (Qwen3.5: the first quarter)
    moe: MoEConfig | None = None  # the mixture-of-experts MLPs and the layers that have them; None: all dense
    mrope_section: tuple[int, ...] = ()  # M-RoPE (Qwen3.5): rotary frequencies per (time, height, width) row
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.layer_kinds:
            object.__setattr__(self, "layer_kinds", ("attention",) * self.num_layers)
        problems = []
        check_supported(self.arch)  # refuses an architecture no model class computes
        all_moe = self.moe is not None and len(set(self.moe.layers)) == self.num_layers
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position"):
            if getattr(self, name) <= 0 and not (name == "intermediate_size" and all_moe and self.intermediate_size == 0):
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if len(self.layer_kinds) != self.num_layers or not set(self.layer_kinds) <= set(LAYER_KINDS):
            problems.append(f"layer_kinds {self.layer_kinds} must name one of {LAYER_KINDS} per layer")
        elif "attention" not in self.layer_kinds:
            problems.append("at least one layer must be an attention layer")
        n = self.linear
        if n is not None and (min(n.num_k_heads, n.num_v_heads, n.head_k_dim, n.head_v_dim, n.conv_kernel) <= 0
                              or n.num_v_heads % n.num_k_heads):
            problems.append(f"linear attention {n} needs positive sizes and value heads a multiple of key heads")
        if not 0 < self.partial_rotary <= 1 or int(self.head_dim * self.partial_rotary) % 2:
            problems.append(f"partial_rotary_factor {self.partial_rotary} must leave an even number of rotated dims")
        if self.moe is not None:
            problems += self.moe.problems(self.num_layers)
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if problems:
            raise ModelLoadError("The model's configuration is invalid: " + "; ".join(problems) + ".",
                                 "The file is damaged or was converted wrongly; re-download or re-convert it.")

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else the dense gated MLP, intermediate_size)."""
        return self.moe is not None and layer in self.moe.layers

    @property
    def attention_layers(self) -> int:
        """Layers that keep KV (the KV cache's layer count)."""
        return self.layer_kinds.count("attention")

    def kind_ordinals(self) -> list[int]:
        """Per layer, its index among the layers of its kind (an attention layer's KV-cache layer, a recurrent
        layer's state-pool layer)."""
        seen: dict[str, int] = {}
        out = []
        for kind in self.layer_kinds:
            out.append(seen.get(kind, 0))
            seen[kind] = out[-1] + 1
        return out

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Every parameter the model class of this architecture reads (embeddings, lm_head unless tied, each layer's
        tensors for its kind: engine.model.registry), as its loader checks them."""
        from engine.model.registry import model_class

        return sum(math.prod(shape) for shape in model_class(self.arch).expected_shapes(self).values())
