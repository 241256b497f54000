"""Model shapes the ledger plans for: from a config, a file's metadata, or a synthetic name."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from engine.errors import ModelLoadError
from engine.ledger.common import GIB, SYNTHETIC_NAMES, WEIGHT_BITS
from engine.ledger.vision import VisionShape
from engine.memory.dtypes import FLOAT_FORMATS, auto_float
from engine.memory.geometry import KV_LAYOUTS
from engine.memory.specs import gated_delta_spec


@dataclass(frozen=True)
class LinearAttention:
    """Linear-attention (Gated-DeltaNet) layers: a fixed-size recurrent state per sequence instead of KV."""

    layers: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dim: int = 0
    conv_kernel: int = 4
    kind: str = "gated-deltanet"
    conv_dtype: str = "bfloat16"  # the conv window is kept in the activations' dtype: bf16 on a GPU (on_device)

    def state_bytes(self, fp16: bool = False) -> int:
        """Per sequence: the layers' cache spec (engine/memory/specs.gated_delta_spec), the delta-rule state in fp32
        (fp16 with --gdn-state-fp16) and the conv window."""
        return self.layers * gated_delta_spec(self, self.conv_dtype, "float16" if fp16 else "float32").nbytes


@dataclass(frozen=True)
class ModelShape:
    """What the ledger needs to know about a model. ``stored_bytes``: weight bytes as stored in the file (0 when
    unknown); ``weight_bytes_by_dtype`` pins known sizes (e.g. a published ternary file) over the formula."""

    name: str
    layers: int
    full_attention_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params: int
    heads: int = 0
    intermediate: int = 0
    max_position: int = 4096
    stored_bytes: int = 0
    stored_format: str = ""
    source: str = "config"  # "config", "gguf", "hf", "synthetic"
    linear: LinearAttention | None = None
    mtp_layers: int = 0
    spec_state_bytes: int | None = None
    recurrent_layers: int = 0  # layers with a recurrent state other than Gated-DeltaNet (from the model's specs)
    weight_bytes_by_dtype: Mapping[str, int] = field(default_factory=dict)
    moe_layers: int = 0  # layers whose MLP is a mixture of experts
    expert_params: int = 0  # their routed experts' parameters, all MoE layers together (what --n-cpu-moe moves)
    experts: tuple[int, int] = (0, 0)  # (experts per MoE layer, experts a token runs)
    vision: VisionShape | None = None  # a vision-language model's tower (engine/ledger/vision.py); None: text only

    # -- constructors
    @classmethod
    def from_config(cls, cfg: Any, *, stored_bytes: int = 0, stored_format: str = "", source: str = "config",
                    params: int | None = None, cache_specs: list | None = None, mtp_layers: int = 0) -> "ModelShape":
        """From an engine ModelConfig: KV for its attention layers, and for a hybrid the linear-attention layers'
        state (cfg.linear: the GDN state in fp32 or fp16, the conv window in bf16, as on a GPU). `cache_specs` (a
        built model's, per layer, engine/memory/specs.py) give the recurrent state a sequence holds exactly, in the
        dtypes that model chose; `mtp_layers`: the checkpoint's MTP layers."""
        recurrent = [s for s in cache_specs or () if s.kind == "recurrent"]
        n, linear_layers = getattr(cfg, "linear", None), cfg.layer_kinds.count("recurrent")
        linear = None
        if n is not None and linear_layers:
            linear = LinearAttention(linear_layers, n.num_v_heads, n.head_k_dim, n.head_v_dim, n.conv_dim,
                                     n.conv_kernel)
        moe = getattr(cfg, "moe", None)
        moe_fields = {} if moe is None else {
            "moe_layers": len(moe.layers), "experts": (moe.num_experts, moe.top_k),
            "expert_params": len(moe.layers) * moe.num_experts * 3 * cfg.hidden_size * moe.expert_size}
        return cls(name=cfg.name or cfg.arch, layers=cfg.num_layers, full_attention_layers=cfg.attention_layers,
                   kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                   params=params or cfg.num_parameters(), heads=cfg.num_heads, intermediate=cfg.intermediate_size,
                   max_position=cfg.max_position, stored_bytes=stored_bytes, stored_format=stored_format,
                   source=source, linear=linear, mtp_layers=mtp_layers, recurrent_layers=len(recurrent),
                   spec_state_bytes=sum(s.nbytes for s in recurrent) if recurrent else None, **moe_fields)

    @classmethod
    def synthetic(cls, name: str) -> "ModelShape":
        if name != "qwen3.5-27b-like":
            raise ModelLoadError(f"No synthetic model shape named {name!r}.",
                                 f"Use one of: {', '.join(SYNTHETIC_NAMES)}, or a model path.")
        return _qwen35_27b_like()

    @classmethod
    def from_path(cls, path: str | Path | None) -> "ModelShape":
        """A synthetic name, a GGUF file or a Hugging Face folder (metadata only), or None for the embedded model."""
        if path is not None and str(path) in SYNTHETIC_NAMES:
            return cls.synthetic(str(path))
        from engine.model.inspect import inspect

        return cls.from_info(inspect(path))

    @classmethod
    def from_info(cls, info: Any) -> "ModelShape":
        """From a model's metadata (engine.model.inspect.ModelInfo): its config when the engine runs it, else the
        dimensions read from the file."""
        if info.config is not None:
            shape = cls.from_config(info.config, stored_bytes=info.stored_bytes, stored_format=info.stored_format,
                                    source=info.kind, params=info.params or None, mtp_layers=info.mtp_layers)
            where = Path(info.path)  # the tower: the folder's own, or the mmproj file beside a GGUF
            return replace(shape, vision=VisionShape.from_folder(where) if where.is_dir() else
                           VisionShape.from_gguf(where))
        return cls(name=info.name, params=info.params, stored_bytes=info.stored_bytes,
                   stored_format=info.stored_format, source=info.kind, mtp_layers=info.mtp_layers,
                   linear=LinearAttention(*info.linear) if info.linear else None, **info.dims)

    def on_device(self, on_gpu: bool, weight_dtype: str = "auto") -> "ModelShape":
        """This shape with the linear-attention conv window in the dtype the engine keeps it in on that device with
        that --weight-dtype (its float format; auto and the low-bit formats: dtypes.auto_float); unchanged without
        one, or when a built model's specs count it."""
        if self.linear is None or self.spec_state_bytes is not None:
            return self
        conv = FLOAT_FORMATS.get(weight_dtype) or auto_float(on_gpu)
        return replace(self, linear=replace(self.linear, conv_dtype=conv.torch_name))

    # -- derived numbers
    @property
    def linear_layers(self) -> int:
        """Layers with a recurrent state instead of KV."""
        return self.linear.layers if self.linear else self.recurrent_layers

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return KV_LAYOUTS[kv_dtype].bytes_per_token(self.full_attention_layers, self.kv_heads, self.head_dim)

    def state_bytes(self, fp16: bool = False) -> int:
        """Recurrent-state bytes per sequence (0 for pure attention models)."""
        if self.spec_state_bytes is not None:
            return self.spec_state_bytes
        return self.linear.state_bytes(fp16) if self.linear else 0

    def weight_bytes(self, dtype: str = "auto") -> int:
        """``auto``: as stored in the file (bf16 when unknown); otherwise parameters x the format's bits."""
        if dtype == "auto":
            return self.stored_bytes or self.params * 2
        if dtype in self.weight_bytes_by_dtype:
            return int(self.weight_bytes_by_dtype[dtype])
        return int(self.params * WEIGHT_BITS[dtype] / 8)

    def expert_bytes(self, dtype: str = "auto", layers: int | None = None) -> int:
        """The routed experts' share of weight_bytes(dtype), of `layers` MoE layers (default: all of them)."""
        if not self.moe_layers or not self.params:
            return 0
        n = self.moe_layers if layers is None else min(layers, self.moe_layers)
        return round(self.weight_bytes(dtype) * self.expert_params / self.params * n / self.moe_layers)

    def mtp_params(self) -> int:
        """One decoder layer (attention + MLP) and the 2h -> h projection; embeddings and lm_head are shared."""
        h = self.hidden
        q = (self.heads or self.hidden // self.head_dim) * self.head_dim
        gate = q if self.linear else 0  # the hybrids' gated attention: q_proj also gives each head its output gate
        attn = 2 * h * q + h * gate + 2 * h * self.kv_heads * self.head_dim
        mlp = 3 * h * (self.intermediate or 3 * h)
        return attn + mlp + 2 * h * h + 4 * h


def _qwen35_27b_like() -> ModelShape:
    """Qwen3.5-27B's text model: 64 layers in blocks of 3 Gated-DeltaNet + 1 full attention (24 q heads, 4 KV heads x
    256, gated q), hidden 5120, MLP 17,408, vocab 248,320, untied embeddings, one MTP layer. Parameters ~26.9 B
    (bf16 53.8 GB: "~54 GB" in the seeds; the published 55.6 GB adds the vision tower and the MTP layer)."""
    h, vocab, inter, layers, full = 5120, 248_320, 17_408, 64, 16
    heads, kv_heads, hd = 24, 4, 256
    kh, vh, kd, vd, kernel = 16, 48, 128, 128, 4
    conv_dim = 2 * kh * kd + vh * vd
    mlp = 3 * h * inter
    attn = h * heads * hd * 2 + 2 * h * kv_heads * hd + heads * hd * h + 2 * hd  # q (+ output gate), k, v, o, q/k norms
    gdn = h * (conv_dim + vh * vd + 2 * vh) + conv_dim * kernel + vh * vd * h + 2 * vh + vd  # in_proj qkv/z/b/a, conv,
    # out_proj, A_log + dt_bias, norm
    params = 2 * vocab * h + full * (attn + mlp + 2 * h) + (layers - full) * (gdn + mlp + 2 * h) + h
    return ModelShape(
        name="qwen3.5-27b-like", layers=layers, full_attention_layers=full, kv_heads=kv_heads, head_dim=hd, hidden=h,
        vocab=vocab, params=params, heads=heads, intermediate=inter, max_position=262_144, stored_bytes=params * 2,
        stored_format="bf16 (synthetic)", source="synthetic",
        linear=LinearAttention(layers - full, vh, kd, vd, conv_dim, kernel), mtp_layers=1,
        # seed 2: Ternary-Bonsai-2-27B is 6.70 GiB (the formula, 2 bits + an fp16 scale per 64, gives 7.05 GiB)
        weight_bytes_by_dtype={"ternary": round(6.70 * GIB)})
