"""Mixture-of-experts MLPs (Qwen3.5/3.6-MoE, Qwen3-Next): a router picks `top_k` of `num_experts` SwiGLU experts per
token, and a shared expert, scaled by a sigmoid gate, runs for every token.

Routing as transformers' Qwen3_5MoeTopKRouter and llama.cpp's build_moe_ffn: logits = x @ gate.T, a float32 softmax
over all experts, the top k, divided by their sum (`norm_topk`). The router and the shared gate are kept float32
whatever the model's dtype (a bf16 router flips near-tied experts). Each expert is two of our Linear layers (fused
gate|up, down), so low-bit formats and GGUF types reach experts as they reach every other weight.

Compute reads only what the tokens use. Where Triton runs (CUDA; the interpreter in the tests) the routed experts are
two launches of kernels/moe.py over the layer's experts stacked once (`stack_linears`: each expert's Linear then views
into the stack, no second copy). Elsewhere, and for experts in host memory: one token runs its k experts; a batch of
tokens is grouped by expert, one matmul per expert that any token picked, its rows scattered back weighted
(index_add), never one per token; on the CPU, where the kernel computes what that loop does, in one C++ call
(engine/model/moe_prompt.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.layers import silu_and_mul
from engine.model.linear import Linear, Weight, fuse
from engine.model.moe_prompt import prompt_operands, routed_prompt
from kernels import dispatch
from kernels.quant import QuantizedWeight, row_slice


def moe_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one MoE MLP under HF names (experts one by one, as transformers' save_pretrained writes them)."""
    m, h = cfg.moe, cfg.hidden_size
    mlp = p + "mlp."
    shapes = {mlp + "gate.weight": (m.num_experts, h)}
    for e in range(m.num_experts):
        x = f"{mlp}experts.{e}."
        shapes |= {x + "gate_proj.weight": (m.expert_size, h), x + "up_proj.weight": (m.expert_size, h),
                   x + "down_proj.weight": (h, m.expert_size)}
    if m.shared_size:
        s = mlp + "shared_expert."
        shapes |= {s + "gate_proj.weight": (m.shared_size, h), s + "up_proj.weight": (m.shared_size, h),
                   s + "down_proj.weight": (h, m.shared_size), mlp + "shared_expert_gate.weight": (1, h)}
    return shapes


def dense_mlp_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)}


def mlp_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The MLP tensors of the layer under prefix `p`: the experts where the config makes it a MoE layer, else the
    dense gated MLP. A block outside model.layers (the MTP block, p = "") is MoE where every layer of the model is."""
    if p.startswith("model.layers."):
        moe = cfg.is_moe(int(p.split(".")[2]))
    else:
        moe = cfg.moe is not None and len(set(cfg.moe.layers)) == cfg.num_layers
    return moe_shapes(cfg, p) if moe else dense_mlp_shapes(cfg, p)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _stack_key(w: Weight) -> tuple:
    if isinstance(w, torch.Tensor):
        return tuple(w.shape), w.dtype, w.device
    return (w.shape, w.format, w.group_size, w.qweight.dtype, w.scales.dtype,
            None if w.mins is None else w.mins.dtype, w.device)


def stackable(linears: list[Linear]) -> bool:
    """The linears' weights are of one shape, dtype, format and device, without a bias."""
    return all(lin.bias is None for lin in linears) and len({_stack_key(lin.weight) for lin in linears}) == 1


def _empty_stack(w: Weight, e: int) -> Weight:
    if isinstance(w, torch.Tensor):
        return torch.empty(e, *w.shape, dtype=w.dtype, device=w.device)
    rows = lambda t: None if t is None else t.new_empty(e * t.shape[0], t.shape[1])  # noqa: E731
    return QuantizedWeight(w.format, rows(w.qweight), rows(w.scales), rows(w.mins), w.group_size,
                           (e * w.out_features, w.in_features))


def stack_linears(linears: list[Linear]) -> Weight:
    """The `stackable` linears' weights as one stack, dense [E, N, K] or a QuantizedWeight [E * N, K] (rows per
    expert), that each Linear then views into. Copied one expert at a time: an expert's own tensor goes as soon as
    its Linear holds the view, unless something else holds it (while a model is built, its dict of converted tensors
    keeps the down weights until the end of the build)."""
    first = linears[0].weight
    stack, n = _empty_stack(first, len(linears)), first.shape[0]
    del first
    for i, lin in enumerate(linears):
        if isinstance(stack, torch.Tensor):
            lin.weight = stack[i].copy_(lin.weight)
            continue
        view = row_slice(stack, i * n, n)
        for part in ("qweight", "scales", "mins"):
            if getattr(view, part) is not None:
                getattr(view, part).copy_(getattr(lin.weight, part))
        lin.weight = view
    return stack


class Expert:
    """One SwiGLU expert (also the shared expert): down(silu(gate(x)) * up(x))."""

    def __init__(self, w: dict, prefix: str):
        self.gate_up = Linear(fuse([w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]]))
        self.down = Linear(w[prefix + "down_proj.weight"])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_and_mul(self.gate_up(x)))

    def linears(self) -> list[Linear]:
        return [self.gate_up, self.down]


class MoEMLP:
    def __init__(self, cfg: ModelConfig, w: dict, prefix: str):
        m, p = cfg.moe, prefix + "mlp."
        self.top_k, self.renormalize = m.top_k, m.norm_topk
        self.router = w[p + "gate.weight"].float()
        self.experts = [Expert(w, f"{p}experts.{e}.") for e in range(m.num_experts)]
        self.shared = Expert(w, p + "shared_expert.") if m.shared_size else None
        self.shared_gate = w[p + "shared_expert_gate.weight"].float() if m.shared_size else None
        self.host = False  # the routed experts live in host memory (--n-cpu-moe): computed there, in host_dtype
        self.host_dtype = torch.float32
        self.stacks: tuple | None = None  # (gate_up, down) for kernels/moe.py; () where the experts do not stack
        device = self.experts[0].down.weight.device
        if device.type == "cuda" and dispatch.use_triton(device):
            self.stack_experts()  # at load, before the KV pools are sized on the memory left

    def stack_experts(self) -> tuple:
        """The routed experts' stacks (`stack_linears`; built once: at load on CUDA, else at the first call where
        Triton runs), or () where the experts differ."""
        if self.stacks is None:
            groups = [[x.gate_up for x in self.experts], [x.down for x in self.experts]]
            self.stacks = tuple(map(stack_linears, groups)) if all(map(stackable, groups)) else ()
        return self.stacks

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(h.float(), self.router), self.top_k, self.renormalize)
        if not self.host:
            out = self._routed(h, weights, ids)
            return out if self.shared is None else out + self._shared(h)
        x, weights, ids = h.to("cpu", self.host_dtype), weights.cpu(), ids.cpu()
        shared = None if self.shared is None else self._shared(h)  # queued on the device while the CPU computes
        out = self._routed(x, weights, ids).to(h.device, h.dtype)
        return out if shared is None else out + shared

    def _routed(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.host and dispatch.use_triton(h.device) and self.stack_experts():
            return dispatch.fused_moe(h, *self.stacks, weights, ids)
        if h.shape[0] == 1:
            return self._one_token(h, weights, ids)
        if h.device.type == "cpu" and h.dtype == torch.float32 and not dispatch.use_triton(h.device) \
                and all(type(x) is Expert for x in self.experts):  # the kernel computes what Expert computes
            operands = prompt_operands(self.experts)
            if operands is not None:
                return routed_prompt(h, weights, ids, operands)
        return self._grouped(h, weights, ids)

    def _shared(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(h.float(), self.shared_gate)).to(h.dtype) * self.shared(h)

    def _one_token(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = None
        for j, e in enumerate(ids[0].tolist()):
            y = self.experts[e](h) * weights[0, j].to(h.dtype)
            out = y if out is None else out + y
        return out

    def _grouped(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k  # the token of each (token, expert) pair, grouped by expert
        scale = weights.reshape(-1)[order].to(h.dtype).unsqueeze(1)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):
            if n:
                sel = rows[start:start + n]
                out.index_add_(0, sel, self.experts[e](h.index_select(0, sel)) * scale[start:start + n])
                start += n
        return out

    def linears(self) -> list[Linear]:
        """Every linear layer of the block (for the low-bit kernels' marking, engine.model.linear)."""
        out = [lin for e in self.experts for lin in e.linears()]
        return out + (self.shared.linears() if self.shared is not None else [])

    def expert_bytes(self) -> int:
        """The routed experts' bytes (what --n-cpu-moe moves to host memory)."""
        return sum(lin.nbytes for e in self.experts for lin in e.linears())

    def bytes_per_token(self) -> int:
        """Bytes one token reads: the router, the shared expert and gate, and top_k experts (all of a size)."""
        one = sum(lin.nbytes for lin in self.experts[0].linears())
        shared = 0 if self.shared is None else sum(lin.nbytes for lin in self.shared.linears()) \
            + self.shared_gate.numel() * 4
        return self.router.numel() * 4 + shared + self.top_k * one

    def nbytes(self) -> int:
        return self.router.numel() * 4 + sum(lin.nbytes for lin in self.linears()) + \
            (0 if self.shared_gate is None else self.shared_gate.numel() * 4)


class GatedMLP:
    """The MLP part of a decoder layer, dense or MoE: `self.moe` is the MoE block where the layer's tensors hold one
    (its router's weight), else None and `gate_up` / `down` are the dense gated MLP (which the C++ decode steps
    read)."""

    def init_mlp(self, cfg: ModelConfig, w: dict, prefix: str) -> None:
        self.moe = MoEMLP(cfg, w, prefix) if cfg.moe is not None and prefix + "mlp.gate.weight" in w else None
        if self.moe is None:
            self.gate_up = Linear(fuse([w[prefix + "mlp.gate_proj.weight"], w[prefix + "mlp.up_proj.weight"]]))
            self.down = Linear(w[prefix + "mlp.down_proj.weight"])

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h) if self.moe is not None else self.down(silu_and_mul(self.gate_up(h)))
