"""Per-dtype tolerances for comparing a kernel with its twin, and the check itself.

A value passes when |actual - expected| <= rtol * |expected| + atol * max|expected| (atol is relative to the
tensor's scale, so near-zero entries of a well-scaled result are not held to a relative bound).

* float32: both sides compute in float32; only the summation order differs: rtol 1e-5, atol 1e-5.
* float16: inputs are exact in float32; results are rounded once to fp16 (2^-11 relative) on each side, in a
  possibly different place of the last bit: rtol 2e-3 (2 ulp), atol 1e-3.
* bfloat16: as fp16 with 2^-8; in addition the Triton interpreter *truncates* float32 -> bf16 (measured: it agrees
  with round-to-nearest on ~50% of values and with truncation on 100%), so kernel and twin differ by up to 1 ulp per
  rounding step, 2 steps in RMSNorm: rtol 1.6e-2 (2 ulp), atol 8e-3.
"""
import torch

TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 8e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, what: str = ""):
    rtol, atol = TOL[dtype or expected.dtype]
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = actual.float(), expected.float()
    scale = e.abs().max().item() if e.numel() else 0.0
    bound = rtol * e.abs() + atol * scale
    bad = (a - e).abs() > bound
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        worst = ((a - e).abs() / (e.abs() + 1e-30)).flatten()[bad.flatten()].max().item()
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.numel()} values out of tolerance (rtol {rtol}, atol "
                             f"{atol} x {scale:.3g}); first at flat index {i}: {a.flatten()[i].item()} vs "
                             f"{e.flatten()[i].item()}; worst relative error {worst:.3g}")
