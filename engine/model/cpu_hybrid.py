"""A Qwen3.5-class hybrid's CPU decode step as one C++ call (kernels/cpu_hybrid.cpp, --cpu-compile auto).

As engine/model/cpu_fused.py does for llama-family models: every decode step runs the whole stack in C++, the GDN
layers over each row's state slot (the conv window and the delta-rule state, float32 or float16 storage), the gated
attention layers over each row's pages, and each layer's MLP, dense or a mixture of experts (kernels/cpu_moe.cpp:
the router, each row's top-k experts, the shared expert). Each linear is read as loaded: dense float32 (the C++
GEMV) or a low-bit weight the C++ kernel reads. The embedding lookup and the output layer stay in Python."""
from __future__ import annotations

import logging

import torch

from engine.model import cpu_fused
from engine.model.cpu_fused import FusedDecode, linear_entries, readable, unreadable
from engine.model.gdn import GDNLayer
from engine.model.linear import layer_linears
from engine.model.qwen35 import GatedAttentionLayer, Qwen35Model
from kernels import cpu_native

log = logging.getLogger("ninfer.model")

MIXERS = {GDNLayer: ("in_proj", "out"), GatedAttentionLayer: ("qkv", "o")}  # then each layer's MLP


def is_hybrid(model) -> bool:
    return isinstance(model, Qwen35Model)


def why_not(model, kv, state) -> str | None:
    """None when the hybrid `model` on cache `kv` and state pool `state` decodes through hybrid_step; else why not
    (hybrid_step takes no biases: Qwen3.5 has none)."""
    why = unreadable(model, kv, Qwen35Model, MIXERS, "a Qwen3.5 hybrid of GDN and gated attention layers", False)
    if why is None and not all(readable(lin) and lin.bias is None for layer in model.layers
                               for lin in layer_linears(layer)):
        return "not every MLP weight of the layers is one the C++ decode kernels read"
    if why is None and (state is None or any(t["conv"].dtype != torch.float32 for t in state.layers)):
        return "the GDN conv states are not float32"
    return why


def moe_entries(moe) -> tuple[list, list[int]]:
    """A MoE MLP's entries for kernels/cpu_moe.cpp (read_moe: router, shared gate, the shared expert's gate_up and
    down, then each expert's) and the symmetry flags of its linears."""
    entries, syms = [moe.router.contiguous(), None if moe.shared_gate is None else moe.shared_gate.contiguous()], []
    for expert in [moe.shared, *moe.experts]:
        for lin in (expert.linears() if expert is not None else [None, None]):
            e, sym = linear_entries(lin) if lin is not None else ([None] * 3, 0)
            entries += e
            syms.append(sym)
    return entries, syms


class HybridDecode(FusedDecode):
    """Decode steps of one ModelRunner's Qwen3.5 hybrid as one C++ call each (`why_not` must have said None)."""

    source = "kernels/cpu_hybrid.cpp"

    def __init__(self, runner):
        self.model, self.kv, self.page_size, self.state = runner.model, runner.kv, runner.page_size, runner.state
        cfg, n = self.model.cfg, self.model.cfg.linear
        self.weights: list[torch.Tensor | None] = []
        self.syms: list[int] = []
        self.kinds: list[int] = []
        self.moe_weights: list[torch.Tensor | None] = []
        self.moe_at: list[int] = []
        self.moe_syms: list[int] = []
        for layer in self.model.layers:
            self.weights += [layer.input_norm.float().contiguous(), layer.post_norm.float().contiguous()]
            mlp = [None, None] if layer.moe is not None else [layer.gate_up, layer.down]
            for lin in [getattr(layer, name) for name in MIXERS[type(layer)]] + mlp:
                entries, sym = linear_entries(lin) if lin is not None else ([None] * 3, 0)
                self.weights += entries
                self.syms.append(sym)
            self.moe_at.append(len(self.moe_weights) if layer.moe is not None else -1)
            if layer.moe is not None:
                entries, syms = moe_entries(layer.moe)
                self.moe_weights += entries
                self.moe_syms += syms
            if isinstance(layer, GDNLayer):
                self.weights += [layer.conv.contiguous(), layer.dt_bias.contiguous(), layer.neg_a.contiguous(),
                                 layer.norm.contiguous()]
            else:
                self.weights += [layer.q_norm.float().contiguous(), layer.k_norm.float().contiguous(), None, None]
            self.kinds.append(int(isinstance(layer, GatedAttentionLayer)))
        self.norm = self.model.norm.float().contiguous()
        rotated = int(cfg.head_dim * cfg.partial_rotary)
        self.dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotated, n.num_k_heads, n.num_v_heads,
                     n.head_k_dim, n.head_v_dim, n.conv_kernel]
        self.eps = cfg.rms_eps
        m = cfg.moe
        self.moe_dims = [] if m is None else [m.num_experts, m.top_k, int(m.norm_topk)]
        self.conv_states = [t["conv"] for t in self.state.layers]  # the pool's tensors, allocated once
        self.ssm_states = [t["ssm"] for t in self.state.layers]
        self.moe_layers = cpu_native.moe_layers(self.moe_weights, self.moe_at, self.moe_syms, self.moe_dims,
                                                cfg.hidden_size)
        self.op = cpu_native.hybrid_step_op()
        self.steps = 0

    def call(self, x, positions, slots, table, ctx, state_slots) -> torch.Tensor:
        rotary = self.model.rotary
        return self.op(x, self.weights, self.kinds, self.syms, self.norm, self.kv.k, self.kv.v, self.conv_states,
                       self.ssm_states, torch.tensor(state_slots), rotary.cos, rotary.sin, positions, slots, table,
                       ctx, self.dims, self.eps, self.moe_layers)


def make(runner) -> FusedDecode | None:
    """The runner's C++ decode step: a hybrid's (HybridDecode) or a llama-family model's (FusedDecode); None where
    neither runs it (the reason logged once)."""
    hybrid = is_hybrid(runner.model)
    why = why_not(runner.model, runner.kv, runner.state) if hybrid else cpu_fused.why_not(runner.model, runner.kv)
    if why is not None:
        log.info("decode steps run layer by layer in Python: %s", why)
        return None
    fused = HybridDecode(runner) if hybrid else FusedDecode(runner)
    log.info("decode steps run as one C++ call each (%s)", fused.source)
    return fused
