"""A Gated-DeltaNet decoder layer (the linear-attention layers of Qwen3.5 / Qwen3-Next hybrids), computing over the
state pool: each sequence's conv window and delta-rule state live in its slot (engine/memory/state.py).

Per token: in_proj_qkv -> causal depthwise conv (kernel K, SiLU) -> q, k (L2-normed, q scaled by Dk^-0.5, each key
head serving HV / HK consecutive value heads), v; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) in
float32; the gated delta rule (kernels.dispatch gdn_chunked over a prompt, gdn_recurrent for the one-token steps
of many sequences at once, over their state slots; Triton on CUDA, the PyTorch twins elsewhere); a gated
RMSNorm (plain weight) times silu(z); out_proj. Then the MLP (dense or MoE, engine/model/moe.py), as in the
attention layers.

The delta-rule state may be stored in fp16 (--gdn-state-fp16): it is read into fp32, updated in fp32 and rounded
when stored (once per step, and at a snapshot's page boundary, so a sequence resumed from the snapshot continues
exactly as the run that saved it); the read-out stays fp32 up to the gated norm (an fp16 read-out overflows on long
prompts in other engines)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.memory.specs import gated_delta_spec
from engine.batch import ForwardBatch
from engine.model.config import ModelConfig
from engine.model.layers import rms_norm
from engine.model.linear import Linear, fuse
from engine.model.moe import GatedMLP
from kernels import dispatch


def gdn_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one GDN layer under HF names (Qwen3_5 flat projections)."""
    n, h = cfg.linear, cfg.hidden_size
    a = p + "linear_attn."
    return {a + "in_proj_qkv.weight": (n.conv_dim, h), a + "in_proj_z.weight": (n.value_dim, h),
            a + "in_proj_b.weight": (n.num_v_heads, h), a + "in_proj_a.weight": (n.num_v_heads, h),
            a + "conv1d.weight": (n.conv_dim, 1, n.conv_kernel), a + "dt_bias": (n.num_v_heads,),
            a + "A_log": (n.num_v_heads,), a + "norm.weight": (n.head_v_dim,), a + "out_proj.weight": (h, n.value_dim)}


class GDNLayer(GatedMLP):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, activation_dtype: str,
                 state_dtype: str = "float32"):
        n, a = cfg.linear, prefix + "linear_attn."
        self.cfg, self.n = cfg, n
        self.input_norm, self.post_norm = w[prefix + "input_layernorm.weight"], w[prefix + "post_attention_layernorm.weight"]
        # one GEMM for the four input projections: [qkv | z | b | a]
        self.in_proj = Linear(fuse([w[a + "in_proj_qkv.weight"], w[a + "in_proj_z.weight"], w[a + "in_proj_b.weight"],
                                    w[a + "in_proj_a.weight"]]))
        self.conv = w[a + "conv1d.weight"].reshape(n.conv_dim, n.conv_kernel).float()
        self.dt_bias = w[a + "dt_bias"].float()
        self.neg_a = -w[a + "A_log"].float().exp()
        self.norm = w[a + "norm.weight"].float()
        self.out = Linear(w[a + "out_proj.weight"])
        self.init_mlp(cfg, w, prefix)
        self.cache_spec = gated_delta_spec(n, activation_dtype, state_dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ordinal: int, batch: ForwardBatch,
                rotary=None, rope_tables=None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, n = self.cfg, self.n
        residual = x if residual is None else residual + x
        h = rms_norm(residual, self.input_norm, cfg.rms_eps)
        proj = self.in_proj(h)
        qkv, z, b, a = proj.split([n.conv_dim, n.value_dim, n.num_v_heads, n.num_v_heads], dim=-1)
        beta = b.float().sigmoid()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        state = batch.state.layers[ordinal]
        if batch.decode is not None:  # a static decode step: one token per row, slots from the table
            mixed = self._decode(qkv, g, beta, state, batch.decode.state_slots)
        else:
            mixed = self._eager(qkv, g, beta, state, batch, ordinal)
        o = rms_norm(mixed.view(-1, n.num_v_heads, n.head_v_dim), self.norm, cfg.rms_eps)
        o = (o * F.silu(z.float().view_as(o))).reshape(-1, n.value_dim).to(x.dtype)
        residual = residual + self.out(o)
        h = rms_norm(residual, self.post_norm, cfg.rms_eps)
        return self.mlp(h), residual

    def _eager(self, qkv, g, beta, state, batch: ForwardBatch, ordinal: int) -> torch.Tensor:
        """The sequences decoding one token step together (batched over their slots); longer ones one at a time."""
        ones, rows, slots = batch.single_token_rows()
        if len(ones) == len(batch.seqs):
            mixed = self._decode(qkv, g, beta, state, slots)
        else:
            mixed = torch.empty(qkv.shape[0], self.n.value_dim, dtype=torch.float32, device=qkv.device)
            if ones:
                mixed[rows] = self._decode(qkv[rows], g[rows], beta[rows], state, slots)
            for s in batch.seqs:
                if s.q_len > 1:
                    span = slice(s.q_start, s.q_start + s.q_len)
                    mixed[span] = self._sequence(qkv[span], g[span], beta[span], state, s.state,
                                                 [(i, snap[ordinal]) for i, snap in s.saves])
        for s in ones:
            for _, snap in s.saves:  # the state after its one token
                for name, t in state.items():
                    snap[ordinal][name].copy_(t[s.state])
        return mixed

    def _decode(self, qkv, g, beta, state, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of B sequences, read from and written back to their state slots [B]: [B, HV * Dv]."""
        x = dispatch.causal_conv_update(qkv, self.conv, state["conv"], slots)
        q, k, v = self._heads(x)
        o = dispatch.gdn_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state["ssm"], slots)
        return o.reshape(qkv.shape[0], -1)

    def _sequence(self, qkv, g, beta, state, slot: int, saves) -> torch.Tensor:
        """One sequence's tokens from its slot's state (written back), saving the state after the tokens `saves`
        names (i, this layer's part of a snapshot: {"conv", "ssm"}); [T, HV * Dv] float32."""
        conv_state, ssm = state["conv"][slot], state["ssm"]
        outs, start = [], 0
        for end in sorted({i + 1 for i, _ in saves} | {qkv.shape[0]}):
            x, conv_state = causal_conv(qkv[start:end].float(), self.conv, conv_state)
            q, k, v = self._heads(x)
            outs.append(dispatch.gdn_chunked(q, k, v, g[start:end], beta[start:end], ssm, slot))
            for i, snap in saves:
                if i + 1 == end:
                    snap["conv"].copy_(conv_state)
                    snap["ssm"].copy_(ssm[slot])
            start = end
        state["conv"][slot].copy_(conv_state)
        return torch.cat(outs).reshape(qkv.shape[0], -1)

    def _heads(self, x):
        """Conv outputs [T, 2 Dk HK + Dv HV] -> q, k [T, HK, Dk] (raw: the rule L2-normalises them and scales q)
        and v [T, HV, Dv], views."""
        n = self.n
        q, k, v = x.split([n.key_dim, n.key_dim, n.value_dim], dim=-1)
        return (q.unflatten(-1, (n.num_k_heads, n.head_k_dim)), k.unflatten(-1, (n.num_k_heads, n.head_k_dim)),
                v.unflatten(-1, (n.num_v_heads, n.head_v_dim)))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then SiLU over a run of one sequence's tokens: x [T, C], weight [C, K], state
    [C, K - 1] (the previous inputs, oldest first). Returns [T, C] and the new state."""
    ext = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [C, K - 1 + T]
    out = F.conv1d(ext[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out.t().contiguous()), ext[:, ext.shape[1] - state.shape[1]:]
