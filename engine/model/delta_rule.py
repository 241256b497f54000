"""The gated delta rule in PyTorch (the reference twin of the kernels to come), and the causal depthwise convolution
that feeds it. Everything is float32; one sequence at a time, heads first.

Per token t, with the state S [H, Dk, Dv] (the read-out o_t = S_t^T q_t):
    S <- exp(g_t) S;   delta = beta_t (v_t - S^T k_t);   S <- S + k_t delta^T;   o_t = S^T q_t

`chunked` computes the same thing a chunk of C tokens at a time. Inside a chunk with cumulative log decay
G_i = g_1 + ... + g_i and A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i, the corrections are
delta = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(G) k) S_0, the outputs
o_i = exp(G_i) S_0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) delta_j, and the state after the chunk
S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j delta_j^T: a few matrix products per chunk instead of C steps."""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv]: outputs [T, H, Dv] and the new state."""
    s = state
    out = []
    for t in range(q.shape[0]):
        o, s = step(q[t], k[t], v[t], g[t], beta[t], s)
        out.append(o)
    return torch.stack(out), s


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the rule for any leading dims (one sequence [H, ...], or a batch of sequences [B, H, ...]):
    q, k [..., Dk], v [..., Dv], g, beta [...], state [..., Dk, Dv]: the output [..., Dv] and the new state."""
    s = state * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("...kv,...k->...v", s, k))
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...kv,...k->...v", s, q), s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `recurrent`, a chunk at a time (padding tokens have k = v = 0, g = beta = 0: they change
    nothing)."""
    length = q.shape[0]
    pad = (-length) % chunk
    heads = q.shape[1]
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)).reshape(heads, -1, chunk) for x in (g, beta))
    cum = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    kb = k * beta[..., None]
    a = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    unit = a + torch.eye(chunk, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(unit, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(u)
    s = state
    for c in range(q.shape[1]):
        delta = u[:, c] - w[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ delta
        s = s * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ delta
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1), s


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then SiLU: x [T, C], weight [C, K], state [C, K - 1] (the previous inputs, oldest
    first). Returns [T, C] and the new state."""
    ext = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [C, K - 1 + T]
    out = F.conv1d(ext[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out.t()), ext[:, ext.shape[1] - state.shape[1]:]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of `causal_conv` for a batch of sequences: x [B, C], weight [C, K], state [B, C, K - 1].
    Returns [B, C] and the new states."""
    ext = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [B, C, K]
    return F.silu((ext * weight.to(x.dtype)).sum(-1)), ext[:, :, 1:]
