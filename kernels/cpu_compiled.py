"""CPU kernels written as PyTorch expressions and compiled by `torch.compile` (inductor emits one fused C++/OpenMP
loop nest per expression; it needs a C++ compiler at the first compile, and reuses its on-disk cache after that).

* `exact_linear(x, qw)`: y = x @ dequantize(qw).T in float32 for grouped int8 weights (codes c, float32 scales d and
  optional mins m per group: w = c*d + m), reading the 1-byte codes directly: y = sum_g d[g] * (x_g . c_g)
  + sum_g m[g] * sum(x_g). Only the summation order differs from a float32 matmul over the dequantized weight (its
  twin: `reference.quant_linear_ref` with float32 activations). A decode step's rows go through the compiled one-row loop, a read of the codes each
  (about 4x fewer bytes than a float32 weight); more rows dequantize blocks of the weight and multiply them.

`ready(qw)` compiles and runs the kernel once for this weight's shape and says whether it works; callers keep a float32
weight instead where it does not (no compiler, a compile error). Where the C++ kernel of kernels/cpu_native.py builds,
it takes the rows instead of the compiled one-row loop (the same products, several times faster on CPUs without
AVX-512), and nothing is compiled here.
"""
from __future__ import annotations

import torch

from kernels import cpu_native
from kernels.quant import QuantizedWeight

MAX_COMPILED_ROWS = 8  # up to this many rows: one compiled pass per row; more: dequantized blocks times all rows
DENSE_BLOCK = 4096  # output rows dequantized at a time on the many-rows path


def _one_row(x: torch.Tensor, c: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x [1, K] float32, c int8 [N, G, S], d (and m) float32 [N, G] -> [1, N]."""
    n, g, s = c.shape
    xg = x.view(g, s)
    y = ((c.float() * xg).sum(-1) * d).sum(-1)
    if m is not None:
        y = y + (m * xg.sum(-1)).sum(-1)
    return y.view(1, n)


_compiled = None


def raise_recompile_limit() -> None:
    """One compiled entry per weight shape (output layers of models loaded one after another, a draft model's) or
    per model (engine/model/cpu_step.py): past dynamo's limit (8 by default) it would run eagerly, correct but slow."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def _kernel():
    global _compiled
    if _compiled is None:
        raise_recompile_limit()
        _compiled = torch.compile(_one_row, dynamic=False, fullgraph=True)
    return _compiled


def supported(qw: QuantizedWeight) -> bool:
    return qw.format == "int8" and qw.scales.dtype == torch.float32 and (qw.mins is None
                                                                         or qw.mins.dtype == torch.float32)


def _operands(qw: QuantizedWeight):
    c = qw.qweight.view(qw.out_features, qw.num_groups, qw.group_size)
    return c, qw.scales, qw.mins


def ready(qw: QuantizedWeight) -> str | None:
    """None when the compiled kernel runs for this weight (compiled now, or found in inductor's cache), else why not."""
    if not supported(qw):
        return f"{qw.format} weights with {qw.scales.dtype} scales are not taken (int8 with float32 scales only)"
    native = cpu_native.supported(qw) and cpu_native.ready() is None
    try:
        with torch.inference_mode():
            x = torch.ones(1, qw.in_features)
            y = cpu_native.q8_linear(x, qw) if native else _kernel()(x, *_operands(qw))
        if y.shape != (1, qw.out_features) or not bool(torch.isfinite(y).all()):
            return "the compiled kernel returned a wrong result"
    except Exception as e:  # no C++ compiler, a compiler error, an inductor limitation: the caller falls back
        return compile_error(e)
    qw.cache["native"] = native
    return None


def compile_error(e: BaseException) -> str:
    """What went wrong in a compile, in one line: the backend's own error where dynamo wraps it."""
    e = getattr(e, "inner_exception", None) or e
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and "TORCHDYNAMO_VERBOSE" not in ln]
    return (lines[0] if lines else type(e).__name__)[:300]


def exact_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """[M, K] float32 -> [M, N] float32 (see the module docstring); `ready(qw)` must have returned None."""
    c, d, m = _operands(qw)
    rows = x.shape[0]
    if rows == 0:
        return x.new_empty(0, qw.out_features)
    if rows <= MAX_COMPILED_ROWS and qw.cache.get("native"):
        return cpu_native.q8_linear(x, qw)
    if rows <= MAX_COMPILED_ROWS:
        with torch.inference_mode():  # the mode it was compiled in (another would compile it again)
            if rows == 1:
                return _kernel()(x.contiguous(), c, d, m)
            return torch.cat([_kernel()(x[i:i + 1].contiguous(), c, d, m) for i in range(rows)])
    out = x.new_empty(rows, qw.out_features)
    for i in range(0, qw.out_features, DENSE_BLOCK):
        j = min(i + DENSE_BLOCK, qw.out_features)
        w = c[i:j].float() * d[i:j, :, None]
        if m is not None:
            w += m[i:j, :, None]
        out[:, i:j] = x @ w.view(j - i, -1).t()
    return out
