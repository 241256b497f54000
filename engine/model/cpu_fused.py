"""The CPU's decode step as one C++ call (kernels/cpu_decode.cpp, --cpu-compile auto).

Eager, a decode step of a small model is ~3,000 small ATen calls around the GEMVs; on two cores the calls cost
more than the GEMVs. Where a llama-family model's decoder layers all decode through the C++ kernels (low-bit or
dense float32 weights, marked by engine/model/linear.use_cpu_kernel) and the KV cache holds floats (float32 or float16), every decode step runs the
whole stack in C++: per layer the same norms and GEMVs as the eager layer, RoPE, the K/V writes and attention over
each row's pages; the embedding lookup and the output layer stay in Python. Any number of sequences, any page
layout; the runner's static forward (engine/model/graphs.py) keeps the steps this does not take.
"""
from __future__ import annotations

import torch

from engine.model.head import embed_rows
from engine.model.linear import Linear
from engine.model.llama import DecoderLayer, LlamaModel
from kernels import cpu_native
from kernels.quant import QuantizedWeight

LINEARS = ("qkv", "o", "gate_up", "down")


def why_not(model, kv) -> str | None:
    """None when `model` on cache `kv` decodes through decode_step; else why not (for the load log)."""
    return unreadable(model, kv, LlamaModel, {DecoderLayer: LINEARS}, "a llama-family decoder of plain attention layers")


def unreadable(model, kv, model_type: type, linears: dict[type, tuple[str, ...]], what: str,
               biases: bool = True) -> str | None:
    """Why a C++ step cannot run `model` on cache `kv` (None: it can): the model and each layer must be exactly of
    the types it knows (a subclass may change what a layer or the final norm computes), its activations float32,
    the linears `linears` names per layer type marked for the C++ kernels (without biases unless `biases`), the KV
    cache float32 or float16, head_dim a multiple of 8."""
    if not cpu_native.loaded():
        return "the C++ kernels are not loaded"
    if type(model) is not model_type or any(type(layer) not in linears for layer in model.layers):
        return f"{type(model).__name__} is not {what}"
    if model.dtype != torch.float32:
        return f"the activations are {model.dtype}, not float32"
    if not all(readable(lin) and (biases or lin.bias is None)
               for layer in model.layers for lin in (getattr(layer, n) for n in linears[type(layer)])):
        return "not every linear weight of the layers is one the C++ decode kernels read"
    fmt = kv.format
    if fmt.k.quantized or fmt.v.quantized or fmt.k.rotate or kv.k[0].dtype not in (torch.float32, torch.float16):
        return f"the KV cache is {kv.kv_dtype} (float32 and float16 are read in C++)"
    if model.cfg.head_dim % 8:
        return f"head_dim {model.cfg.head_dim} is not a multiple of 8"
    return None


class FusedDecode:
    """Decode steps of one ModelRunner's llama-family model as one C++ call each (`why_not` must have said None)."""

    source = "kernels/cpu_decode.cpp"

    def __init__(self, runner):
        self.model, self.kv, self.page_size = runner.model, runner.kv, runner.page_size
        cfg = self.model.cfg
        self.weights: list[torch.Tensor | None] = []
        self.syms: list[int] = []
        for layer in self.model.layers:
            qkv, o, gu, down = [linear_entries(getattr(layer, name)) for name in LINEARS]
            self.weights += [layer.input_norm.float().contiguous(), layer.post_norm.float().contiguous(),
                             *qkv[0], _f32(layer.qkv.bias), *o[0], _f32(layer.o.bias), *gu[0], *down[0],
                             _f32(layer.q_norm), _f32(layer.k_norm)]
            self.syms += [qkv[1], o[1], gu[1], down[1]]
        self.norm = self.model.norm.float().contiguous()
        self.dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim]
        self.eps, self.scale = cfg.rms_eps, cfg.head_dim ** -0.5
        self.op = cpu_native.decode_step_op()
        self.steps = 0

    def hidden(self, tokens: list[int], positions: list[int], pages: list[list[int]],
               state_slots: list[int] | None = None) -> torch.Tensor:
        """The final norm's output [B, hidden] for one token a row at `positions`, each row over its page list
        (which covers its position: the token's K/V are written there) and, for a hybrid, its state slot."""
        ps = self.page_size
        width = max(len(p) for p in pages)
        table = torch.zeros(len(pages), width, dtype=torch.int32)
        for i, p in enumerate(pages):
            table[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
        slots = [p[pos // ps] * ps + pos % ps for p, pos in zip(pages, positions)]
        rotary = self.model.rotary
        if max(positions) >= rotary.cos.shape[0]:
            rotary._extend(max(positions) + 1)
        x = embed_rows(self.model.embed, torch.tensor(tokens)).float().contiguous()
        ctx = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        with torch.inference_mode():
            return self.call(x, torch.tensor(positions), torch.tensor(slots), table, ctx, state_slots)

    def call(self, x, positions, slots, table, ctx, state_slots) -> torch.Tensor:
        rotary = self.model.rotary
        return self.op(x, self.weights, self.syms, self.norm, self.kv.k, self.kv.v, rotary.cos, rotary.sin,
                       positions, slots, table, ctx, self.dims, self.eps, self.scale)

    def run(self, works) -> list[torch.Tensor]:
        """Logits [1, vocab] (float32) per decode work (one token each; pages bound by the caller)."""
        ps = self.page_size
        hidden = self.hidden([w.tokens[0] for w in works], [w.start for w in works],
                             [list(w.pages[: w.start // ps + 1]) for w in works],
                             [w.state.slot if w.state is not None else -1 for w in works])
        self.steps += 1
        with torch.inference_mode():
            logits = self.model.lm_head(hidden).float()
        return [logits[i:i + 1] for i in range(len(works))]


def readable(lin: Linear) -> bool:
    """Whether the C++ step reads this linear's weight: marked by use_cpu_kernel (dense float32 or low-bit)."""
    w = lin.weight
    return lin.native_dense if isinstance(w, torch.Tensor) else bool(w.cache.get("lowbit_native"))


def linear_entries(lin: Linear) -> tuple[list, int]:
    """A linear's three weight entries for the C++ step (codes, scales, mins; or the float32 weight, None, None)
    and its symmetry flag (symmetric 4-bit codes)."""
    w = lin.weight
    if isinstance(w, QuantizedWeight):
        return [w.qweight, w.scales, w.mins], int(w.format == "int4_sym")
    return [w, None, None], 0


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()
