"""The llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) computing over our paged KV cache."""
from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.memory.specs import AttentionSpec
from engine.batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.head import embed_rows, output_layer
from engine.model.interrupt import Interrupt
from engine.model.layers import Rotary, paged_attention, rms_norm, silu_and_mul
from engine.model.linear import Linear, convert, fuse
from engine.model.weights import LoadedWeights


class DecoderLayer:
    """Attention and gated MLP; its K/V live in KV-cache layer `ordinal` (its index among the attention layers)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str):
        def get(name):
            return w.get(prefix + name)

        self.cfg = cfg
        self.input_norm = get("input_layernorm.weight")
        self.post_norm = get("post_attention_layernorm.weight")
        biases = [get(f"self_attn.{n}_proj.bias") for n in "qkv"]
        self.qkv = Linear(fuse([get(f"self_attn.{n}_proj.weight") for n in "qkv"]),
                          torch.cat(biases) if all(b is not None for b in biases) else None)
        self.o = Linear(get("self_attn.o_proj.weight"), get("self_attn.o_proj.bias"))
        self.q_norm = get("self_attn.q_norm.weight")
        self.k_norm = get("self_attn.k_norm.weight")
        # Qwen3's per-head q/k norms as one [Hq + Hkv, D] weight: q and k are normalized (and rotated) as one tensor
        self.qk_norm = None if self.q_norm is None else torch.cat(
            (self.q_norm.expand(cfg.num_heads, -1), self.k_norm.expand(cfg.num_kv_heads, -1)))
        self.gate_up = Linear(fuse([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]))
        self.down = Linear(get("mlp.down_proj.weight"))
        self.cache_spec = AttentionSpec(cfg.num_kv_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ordinal: int, batch: ForwardBatch,
                rotary: Rotary, rope_tables: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables`: this step's Rotary.tables (built once per forward), or None to build them here."""
        cfg = self.cfg
        residual = x if residual is None else residual + x
        h = rms_norm(residual, self.input_norm, cfg.rms_eps)
        qkv = self.qkv(h)
        heads = cfg.num_heads + cfg.num_kv_heads
        qk = qkv[:, :cfg.q_size + cfg.kv_size].view(-1, heads, cfg.head_dim)  # q and k heads, side by side
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, cfg.rms_eps)
        qk = rotary(qk, batch.positions, batch.max_position, rope_tables)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        attn = paged_attention(q, k, v, ordinal, batch, cfg.head_dim ** -0.5)
        x = self.o(attn.reshape(-1, cfg.q_size))
        residual = residual + x
        h = rms_norm(residual, self.post_norm, cfg.rms_eps)
        return self.down(silu_and_mul(self.gate_up(h))), residual


class LlamaModel:
    """The decoder stack. Its layers exist because the config lists them (`ModelConfig.layer_kinds`): make_layer
    builds one per kind, each runs over the cache of its kind at its ordinal among the layers of that kind."""

    def __init__(self, weights: LoadedWeights, dtype: torch.dtype, device: torch.device, weight_format: str = "",
                 keep_native: bool = False, cpu_compile: str = "auto"):
        """dtype: activations and dense weights; weight_format: int8 / int4 / ternary for the linear weights, or
        empty for dense; keep_native: low-bit weights stored in another runnable format keep it (linear.convert);
        cpu_compile: --cpu-compile (engine/model/head.py)."""
        cfg = self.cfg = weights.config
        self.dtype, self.device, self.weight_format = dtype, device, weight_format or str(dtype).split(".")[-1]
        w = {name: convert(name, t, weight_format, *self.placement(name, dtype, device), keep_native)
             for name, t in weights.tensors.items() if name != "rope_freqs"}
        self.embed = w["model.embed_tokens.weight"]
        head = w.get("lm_head.weight")
        if cfg.tie_embeddings:
            head = convert("lm_head.weight", weights.tensors["model.embed_tokens.weight"], weight_format, dtype, device)
        self.lm_head = output_layer(head, dtype, device, cpu_compile)
        self.norm = w["model.norm.weight"]
        self.layers = [self.make_layer(kind, cfg, w, f"model.layers.{i}.") for i, kind in enumerate(cfg.layer_kinds)]
        self.ordinals = cfg.kind_ordinals()
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, weights.tensors.get("rope_freqs"),
                             device)
        self.keep_hidden = False  # set by MTP drafting (engine.speculative.mtp): it reads every last hidden state
        self.hidden: torch.Tensor | None = None  # then: [T, hidden] before the final norm, for the last batch

    def placement(self, name: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.device]:
        """The dtype and device tensor `name` is kept in: the model's (Qwen35Model keeps host experts elsewhere)."""
        return dtype, device

    @classmethod
    def expected_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward pass reads, with its shape (out_features, in_features) for linears."""
        h = cfg.hidden_size
        shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for i, kind in enumerate(cfg.layer_kinds):
            shapes.update(cls.layer_shapes(kind, cfg, f"model.layers.{i}."))
        return shapes

    @classmethod
    def layer_shapes(cls, kind: str, cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
        """The tensors of one layer of this kind (make_layer builds it from them)."""
        if kind != "attention":
            raise ModelLoadError(f"{cfg.arch} has no layers of kind '{kind}'.",
                                 "The model's configuration does not match its architecture; convert it again.")
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        shapes = {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        if cfg.attention_bias:
            for n, size in (("q", q), ("k", kv), ("v", kv)):
                shapes[p + f"self_attn.{n}_proj.bias"] = (size,)
        return shapes

    def make_layer(self, kind: str, cfg: ModelConfig, w: dict, prefix: str):
        self.layer_shapes(kind, cfg, prefix)  # refuses a kind this model has no layer for
        return DecoderLayer(cfg, w, prefix)

    # ---- the checkpoint's multi-token-prediction (MTP) block, built by engine/speculative/mtp.py -----------------
    mtp_reads_normed_hidden = False  # MTP reads the last hidden state before the final norm, and chains its own

    def mtp_norm(self, w: torch.Tensor) -> torch.Tensor:
        """An MTP block's RMSNorm weight as this model's norms scale by it (the llama family: plain, weight * x)."""
        return w

    def mtp_layer(self, cfg: ModelConfig, w: dict[str, torch.Tensor]):
        """The MTP block's decoder layer: one attention layer of this model's kind, from its tensors (names relative
        to the layer, as raw in the checkpoint), in this model's dtype on its device (dense)."""
        return DecoderLayer(cfg, {n: t.to(device=self.device, dtype=self.dtype) for n, t in w.items()}, "")

    @property
    def cache_specs(self) -> list:
        """What each layer keeps per sequence (engine/memory/specs.py), in layer order."""
        return [layer.cache_spec for layer in self.layers]

    def weight_bytes(self) -> int:
        """Bytes the forward pass reads per token: every layer's weights plus the output layer (not the embedding
        table, of which one row is read); of a mixture-of-experts block, the router, shared and top-k experts."""
        total = self.lm_head.nbytes + self.norm.numel() * self.norm.element_size()
        for layer in self.layers:
            for v in vars(layer).values():
                if isinstance(v, Linear):
                    total += v.nbytes
                elif isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
            if getattr(layer, "moe", None) is not None:
                total += layer.moe.bytes_per_token()
        return total

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, interrupt: Interrupt | None = None) -> torch.Tensor:
        """Logits [rows, vocab] (float32) for batch.logit_rows, or for every token when it is None. `interrupt`
        (engine/model/interrupt.py): asked before each layer; the sequences it names leave the batch, and the logits
        are those of the remaining sequences' rows ([0, vocab] when none remains)."""
        x = self.final_hidden(batch, interrupt)
        if x is None:
            return torch.empty(0, self.cfg.vocab_size, device=self.device)
        return self.lm_head(x).float()

    def rope_tables(self, batch: ForwardBatch) -> tuple | None:
        """This step's rotation tables for every layer: M-RoPE's for a step with 3-row positions (images), else
        Rotary.tables (None where the Triton kernel rotates)."""
        if batch.rope_positions is not None:
            if not self.cfg.mrope_section:
                raise ValueError(f"{self.cfg.arch}: 3-row (M-RoPE) positions need the config's mrope_section")
            return self.rotary.mrope_tables(batch.rope_positions, self.cfg.mrope_section)
        return self.rotary.tables(batch.positions, batch.max_position)

    def final_hidden(self, batch: ForwardBatch, interrupt: Interrupt | None = None) -> torch.Tensor | None:
        """The final norm's output for batch.logit_rows (every token when None): what the output layer reads; None
        when `interrupt` took every sequence out. The compiled CPU decode step (engine/model/cpu_step.py) runs this."""
        x = embed_rows(self.embed, batch.input_ids).to(self.dtype)
        if batch.image_rows is not None:  # a prompt chunk with images: the tower's rows replace the lookup's
            rows, values = batch.image_rows
            x = x.index_copy(0, rows, values.to(x.dtype))
        residual = None
        tables = self.rope_tables(batch)
        for layer, ordinal in zip(self.layers, self.ordinals):
            cut = interrupt.cut(batch) if interrupt is not None else None
            if cut is not None:
                batch, rows = cut
                if not batch.seqs:
                    return None
                x, residual = x.index_select(0, rows), None if residual is None else residual.index_select(0, rows)
                tables = self.rope_tables(batch)
            x, residual = layer.forward(x, residual, ordinal, batch, self.rotary, tables)
        x = residual + x
        if self.keep_hidden:
            self.hidden = x
        if batch.logit_rows is not None:
            x = x.index_select(0, batch.logit_rows)
        return rms_norm(x, self.norm, self.cfg.rms_eps)
