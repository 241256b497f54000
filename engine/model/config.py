"""The shape of a model: everything the forward pass needs to know, read from GGUF metadata or config.json."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ModelLoadError

# Architecture families the forward pass implements, with the names they go by in GGUF and HF files.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        problems = []
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(
                f"Model architecture '{self.arch}' is not supported.",
                f"Supported: {', '.join(SUPPORTED_ARCHS)} (SmolLM and Mistral use llama).",
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if problems:
            raise ModelLoadError("The model's configuration is invalid: " + "; ".join(problems) + ".",
                                 "The file is damaged or was converted wrongly; re-download or re-convert it.")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + emb + self.hidden_size
