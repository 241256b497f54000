"""A stand-in hybrid model for the memory seam: a tiny llama whose odd layers are replaced by a simple recurrent
layer (a per-channel decaying sum plus a two-token window, both kept in the state pool), and an independent
reference forward (plain tensors, no pages, no state pool) to check it against.

Recurrent layer, per token t (h_t: the layer's normed input):
    u_t = W_in h_t;  s_t = a * s_{t-1} + u_t;  y_t = W_out (s_t + c1 * w_{t-1} + c2 * w_{t-2});  w <- (h_t, w_{t-1})
with state tensors "sum" [d] and "window" [2, d], zero before the first token."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.memory.specs import RecurrentSpec, StateTensor
from engine.model import registry
from engine.model.layers import rms_norm, silu_and_mul
from engine.model.linear import Linear, fuse
from engine.model.llama import LlamaModel
from engine.model.loader import load_weights
from engine.model.weights import LoadedWeights
from tests.engine.helpers import tiny_hf_model

ARCH = "test-recurrent"
KINDS = ("attention", "recurrent", "attention", "recurrent")


class RecurrentLayer:
    def __init__(self, cfg, w: dict, prefix: str):
        d = cfg.hidden_size
        self.cfg = cfg
        self.input_norm, self.post_norm = w[prefix + "input_layernorm.weight"], w[prefix + "post_attention_layernorm.weight"]
        self.w_in, self.w_out = Linear(w[prefix + "mixer.in_proj.weight"]), Linear(w[prefix + "mixer.out_proj.weight"])
        self.decay, self.mix = w[prefix + "mixer.decay"], w[prefix + "mixer.mix"]
        self.gate_up = Linear(fuse([w[prefix + "mlp.gate_proj.weight"], w[prefix + "mlp.up_proj.weight"]]))
        self.down = Linear(w[prefix + "mlp.down_proj.weight"])
        self.cache_spec = RecurrentSpec((StateTensor("sum", (d,)), StateTensor("window", (2, d))))

    def forward(self, x, residual, ordinal, batch, rotary, rope_tables=None):
        residual = x if residual is None else residual + x
        h = rms_norm(residual, self.input_norm, self.cfg.rms_eps)
        u = self.w_in(h)
        state = batch.state.layers[ordinal]
        out = torch.empty_like(h)
        # a decode step (engine/model/graphs.py) lists its rows' state slots in a table, one token each; the
        # snapshots it saves are stored after the step, outside the layers
        spans = [(row, 1, int(slot), ()) for row, slot in enumerate(batch.decode.state_slots.tolist())] \
            if batch.decode is not None else [(s.q_start, s.q_len, s.state, s.saves) for s in batch.seqs]
        for q_start, q_len, slot, saves in spans:
            total, window = state["sum"][slot].clone(), state["window"][slot].clone()
            for i in range(q_len):
                row = q_start + i
                total = self.decay * total + u[row]
                out[row] = total + self.mix[0] * window[0] + self.mix[1] * window[1]
                window = torch.stack((h[row], window[0]))
                for j, snap in saves:
                    if j == i:
                        snap[ordinal]["sum"].copy_(total)
                        snap[ordinal]["window"].copy_(window)
            state["sum"][slot].copy_(total)
            state["window"][slot].copy_(window)
        residual = residual + self.w_out(out)
        h = rms_norm(residual, self.post_norm, self.cfg.rms_eps)
        return self.down(silu_and_mul(self.gate_up(h))), residual


class RecurrentTestModel(LlamaModel):
    @classmethod
    def layer_shapes(cls, kind, cfg, p):
        if kind != "recurrent":
            return super().layer_shapes(kind, cfg, p)
        d, inter = cfg.hidden_size, cfg.intermediate_size
        return {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "mixer.in_proj.weight": (d, d), p + "mixer.out_proj.weight": (d, d), p + "mixer.decay": (d,),
                p + "mixer.mix": (2, 1), p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                p + "mlp.down_proj.weight": (d, inter)}

    def make_layer(self, kind, cfg, w, prefix):
        return RecurrentLayer(cfg, w, prefix) if kind == "recurrent" else super().make_layer(kind, cfg, w, prefix)


registry.register(ARCH, RecurrentTestModel)
HF_NAME = "RecurrentTestForCausalLM"  # the architecture name its config.json gives (engine.model.config.HF_ARCHS)


def hybrid_weights(tmp_path, seed: int = 0) -> LoadedWeights:
    """A tiny llama (4 layers) turned hybrid: layers 1 and 3 recurrent, with random mixer weights."""
    _, folder = tiny_hf_model("llama", tmp_path, seed=seed, num_hidden_layers=len(KINDS))
    _, weights = load_weights(folder)
    cfg = dataclasses.replace(weights.config, arch=ARCH, layer_kinds=KINDS)
    gen = torch.Generator().manual_seed(seed + 1)
    d = cfg.hidden_size
    tensors = dict(weights.tensors)
    for i, kind in enumerate(KINDS):
        p = f"model.layers.{i}."
        if kind != "recurrent":
            continue
        for name in [n for n in tensors if n.startswith(p + "self_attn.")]:
            del tensors[name]
        tensors[p + "mixer.in_proj.weight"] = 0.2 * torch.randn(d, d, generator=gen)
        tensors[p + "mixer.out_proj.weight"] = 0.2 * torch.randn(d, d, generator=gen)
        tensors[p + "mixer.decay"] = 0.5 + 0.45 * torch.rand(d, generator=gen)
        tensors[p + "mixer.mix"] = 0.5 * torch.randn(2, 1, generator=gen)
    return LoadedWeights(cfg, tensors, "hf")


def write_hybrid_folder(weights: LoadedWeights, folder) -> None:
    """The hybrid as a Hugging Face folder (config.json with layer_types, safetensors, a word-level tokenizer)."""
    import json

    from safetensors.torch import save_file

    from tests.engine.helpers import add_tokenizer

    cfg = weights.config
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [HF_NAME], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position,
              "tie_word_embeddings": False,
              "layer_types": ["linear_attention" if k == "recurrent" else "full_attention" for k in cfg.layer_kinds]}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in weights.tensors.items()}, str(folder / "model.safetensors"))
    add_tokenizer(folder, cfg.vocab_size)


def hybrid_model(tmp_path, seed: int = 0) -> RecurrentTestModel:
    return RecurrentTestModel(hybrid_weights(tmp_path, seed), torch.float32, torch.device("cpu"))


@torch.no_grad()
def reference_logits(weights: LoadedWeights, tokens: list[int]) -> torch.Tensor:
    """Every position's logits, computed over the whole sequence at once from the weights alone: causal softmax
    attention with rotary embeddings for attention layers, the recurrence above for recurrent ones."""
    cfg, w = weights.config, weights.tensors
    eps, hd, n = cfg.rms_eps, cfg.head_dim, len(tokens)

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).float(), torch.cat((ang.sin(), ang.sin()), -1).float()

    def rope(x):  # [n, heads, hd]
        rot = torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), -1)
        return x * cos[:, None] + rot * sin[:, None]

    x = w["model.embed_tokens.weight"][tokens]
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        if kind == "attention":
            q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_heads, hd))
            k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, hd))
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, hd)
            rep = cfg.num_heads // cfg.num_kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            mixed = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
            x = x + mixed @ w[p + "self_attn.o_proj.weight"].T
        else:
            u = h @ w[p + "mixer.in_proj.weight"].T
            a, mix = w[p + "mixer.decay"], w[p + "mixer.mix"]
            total, prev1, prev2, ys = torch.zeros_like(u[0]), torch.zeros_like(u[0]), torch.zeros_like(u[0]), []
            for t in range(n):
                total = a * total + u[t]
                ys.append(total + mix[0] * prev1 + mix[1] * prev2)
                prev1, prev2 = h[t], prev1
            x = x + torch.stack(ys) @ w[p + "mixer.out_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].T
