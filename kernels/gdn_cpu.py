"""The Gated-DeltaNet decode step between a GDN layer's two projections, as one CPU kernel compiled by `torch.compile`
(inductor fuses its ~70 small operations into a few C++ loops; a decode step is op-bound on the CPU).

`gdn_decode(proj, ...)`: for B sequences of one token, from the input projection's output [B, conv | z | b | a]:
beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); the causal conv update + SiLU over each slot's conv
window; q, k L2-normed (q scaled by Dk^-0.5); the gated delta rule's step over each slot's state (read in float32,
written back in its storage dtype); the gated RMSNorm of the read-out times silu(z); [B, value_dim] in proj's
dtype. The states are updated in place. Its twin is the same arithmetic through kernels/reference.py's
`causal_conv_update_ref` and `gdn_recurrent_ref` (engine/model/gdn.py's eager path): only float32 summation order
differs.

`GDNDecode.build(...)` compiles it for one layer shape at batch 1 (one sequence decoding: the desktop's case) and
checks it against the twin; it returns None where it cannot be built (no C++ compiler, a compile error), and callers
keep the eager path. Batches of several sequences stay eager: compiled with a dynamic batch it ran slower than eager
(inductor's loops over symbolic sizes), and one compile per batch size would stall the step that first meets it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.reference import GDN_NORM_EPS, causal_conv_update_ref, gdn_recurrent_ref


@dataclass(frozen=True)
class GDNDims:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def gdn_decode(proj: torch.Tensor, conv_w: torch.Tensor, conv_rows: torch.Tensor, ssm_rows: torch.Tensor,
               neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, eps: float,
               hk: int, hv: int, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring. proj [B, conv + value + 2 hv]; conv_w [conv, K] float32; conv_rows [B, conv, K-1]
    and ssm_rows [B, hv, dk, dv]: the sequences' conv windows and states (as stored); neg_a, dt_bias [hv] and norm_w
    [dv] float32. Returns the read-out [B, value] and the new conv windows and states, as stored."""
    b_rows = proj.shape[0]
    key, value = hk * dk, hv * dv
    conv = 2 * key + value
    qkv, z, b, a = proj.split([conv, value, hv, hv], dim=-1)
    beta = b.float().sigmoid()
    g = neg_a * F.softplus(a.float() + dt_bias)
    window = torch.cat((conv_rows.float(), qkv.float().unsqueeze(-1)), dim=-1)
    x = F.silu((window * conv_w).sum(-1))
    q, k, v = x.split([key, key, value], dim=-1)
    q, k = q.view(b_rows, hk, 1, dk), k.view(b_rows, hk, 1, dk)
    q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + GDN_NORM_EPS) * dk ** -0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + GDN_NORM_EPS)
    rep = hv // hk
    s = ssm_rows.float().view(b_rows, hk, rep, dk, dv) * g.exp().view(b_rows, hk, rep, 1, 1)
    kt = k.view(b_rows, hk, 1, 1, dk)
    kv = (kt @ s).view(b_rows, hk, rep, dv)
    delta = beta.view(b_rows, hk, rep, 1) * (v.view(b_rows, hk, rep, dv) - kv)
    s = s + kt.transpose(-1, -2) * delta.unsqueeze(-2)
    o = (q.view(b_rows, hk, 1, 1, dk) @ s).view(b_rows, hv, dv)
    o = F.rms_norm(o, (dv,), norm_w, eps)
    o = (o * F.silu(z.float().view(b_rows, hv, dv))).reshape(b_rows, value).to(proj.dtype)
    return o, window[..., 1:].to(conv_rows.dtype), s.view(b_rows, hv, dk, dv).to(ssm_rows.dtype)


def gdn_decode_twin(proj, conv_w, conv_state, ssm, slots, neg_a, dt_bias, norm_w, eps, hk, hv, dk, dv):
    """The same step through the reference kernels, as engine/model/gdn.py runs it eagerly."""
    b_rows, key, value = proj.shape[0], hk * dk, hv * dv
    qkv, z, b, a = proj.split([2 * key + value, value, hv, hv], dim=-1)
    beta = b.float().sigmoid()
    g = neg_a * F.softplus(a.float() + dt_bias)
    x = causal_conv_update_ref(qkv, conv_w, conv_state, slots)
    q, k, v = x.split([key, key, value], dim=-1)
    o = gdn_recurrent_ref(q.view(b_rows, 1, hk, dk), k.view(b_rows, 1, hk, dk), v.view(b_rows, 1, hv, dv),
                          g[:, None], beta[:, None], ssm, slots)
    o = F.rms_norm(o.view(b_rows, hv, dv), (dv,), norm_w, eps)
    return (o * F.silu(z.float().view(b_rows, hv, dv))).reshape(b_rows, value).to(proj.dtype)


class GDNDecode:
    """The compiled step for one layer shape at batch 1: `self(proj, ...)` as gdn_decode, proj [1, ...]."""

    TOLERANCE = 1e-4  # of the largest value, against the twin: float32 summation order only

    def __init__(self, dims: GDNDims, eps: float):
        shape = (dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)

        def step(proj, conv_w, conv_rows, ssm_rows, neg_a, dt_bias, norm_w):  # the shape and eps as constants
            return gdn_decode(proj, conv_w, conv_rows, ssm_rows, neg_a, dt_bias, norm_w, eps, *shape)

        self.compiled = torch.compile(step, dynamic=False, fullgraph=True)
        self.dims, self.eps = dims, eps
        self.calls = 0

    def __call__(self, proj, conv_w, conv_state, ssm, slots, neg_a, dt_bias, norm_w) -> torch.Tensor:
        """As gdn_decode_twin: the slot's conv window and state are read, stepped and written back in place."""
        self.calls += 1
        with torch.inference_mode():  # the mode it was compiled in (another would compile it again)
            o, conv_rows, ssm_rows = self.compiled(proj, conv_w, conv_state.index_select(0, slots),
                                                   ssm.index_select(0, slots), neg_a, dt_bias, norm_w)
            conv_state.index_copy_(0, slots, conv_rows)
            ssm.index_copy_(0, slots, ssm_rows)
        return o

    @classmethod
    def build(cls, dims: GDNDims, proj_dtype: torch.dtype, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
              eps: float) -> tuple["GDNDecode | None", str | None]:
        """(the compiled step, None), or (None, why not) where it does not build or does not match its twin."""
        try:
            step = cls(dims, eps)
            why = step._check(proj_dtype, conv_dtype, ssm_dtype)
            if why is not None:
                return None, why
        except Exception as e:  # no C++ compiler, a compiler error, an inductor limitation: the caller stays eager
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "TORCHDYNAMO_VERBOSE" not in ln]
            return None, (lines[0] if lines else type(e).__name__)[:300]
        return step, None

    def _check(self, proj_dtype, conv_dtype, ssm_dtype) -> str | None:
        d, rows = self.dims, 1
        gen = torch.Generator().manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
        proj = rand(rows, d.conv_dim + d.value_dim + 2 * d.num_v_heads).to(proj_dtype)
        weights = (rand(d.conv_dim, d.conv_kernel), -rand(d.num_v_heads).exp(), rand(d.num_v_heads),
                   1 + 0.1 * rand(d.head_v_dim))
        slots = torch.tensor([1])
        first = (rand(3, d.conv_dim, d.conv_kernel - 1).to(conv_dtype),
                 (0.1 * rand(3, d.num_v_heads, d.head_k_dim, d.head_v_dim)).to(ssm_dtype))
        states = [first, tuple(t.clone() for t in first)]
        shape = (d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim)
        args = lambda st: (weights[0], st[0], st[1], slots, weights[1], weights[2], weights[3])  # noqa: E731
        got = self(proj, *args(states[0]))
        with torch.inference_mode():
            want = gdn_decode_twin(proj, *args(states[1]), self.eps, *shape)
        for a, b in ((got, want), (states[0][0], states[1][0]), (states[0][1], states[1][1])):
            scale = b.float().abs().max().clamp_min(1e-6)
            if a.shape != b.shape or not bool(((a.float() - b.float()).abs().max() / scale) <= self.TOLERANCE):
                return "the compiled GDN step differs from its twin"
        return None
