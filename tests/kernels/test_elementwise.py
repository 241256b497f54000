"""Triton RMSNorm (+ residual), RoPE and SiLU-and-mul against their twins (interpreter). Tolerances: tolerances.py."""
import pytest
import torch

from kernels.reference import rms_norm_ref, rope_ref, rope_tables, silu_and_mul_ref
from kernels.rms_norm import rms_norm
from kernels.rope import rope
from kernels.silu_and_mul import silu_and_mul
from tests.kernels.tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [576, 1000])
def test_rms_norm(dtype, n):
    x = torch.randn(7, n, dtype=dtype) * 3
    w = (torch.rand(n) + 0.5).to(dtype)
    assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), what="rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_with_residual(dtype):
    x = torch.randn(2, 5, 576, dtype=dtype)
    r = torch.randn(2, 5, 576, dtype=dtype) * 4
    w = torch.randn(576, dtype=dtype)
    out, res = rms_norm(x, w, 1e-6, residual=r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, residual=r)
    assert out.shape == res.shape == (2, 5, 576) and res.dtype == dtype
    assert_close(res, ref_res, what="new residual")
    assert_close(out, ref_out, what="normed")


def test_rms_norm_weight_dtype_promotes_like_the_twin():
    x = torch.randn(3, 64, dtype=torch.float16)
    w = torch.rand(64)  # float32 weight with fp16 activations -> float32 output, as weight * x16 in torch
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.float32
    assert_close(out, rms_norm_ref(x, w, 1e-5), dtype=torch.float16, what="promote")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,dim", [(9, 64), (3, 128), (5, 96)])
def test_rope(dtype, heads, dim):
    cos, sin = rope_tables(dim, 10000.0, 4096)
    x = torch.randn(6, heads, dim, dtype=dtype)
    pos = torch.tensor([0, 1, 63, 64, 1000, 4095])
    assert_close(rope(x, pos, cos, sin), rope_ref(x, pos, cos, sin), what="rope")


def test_rope_matches_engine_layout_and_in_place():
    """HF convention: x*cos + rotate_half(x)*sin with rotate_half(x) = cat(-x2, x1)."""
    cos, sin = rope_tables(64, 500000.0, 100)
    x = torch.randn(4, 3, 64)
    pos = torch.tensor([5, 0, 99, 7])
    c, s = torch.cat((cos, cos), -1)[pos].unsqueeze(1), torch.cat((sin, sin), -1)[pos].unsqueeze(1)
    hf = x * c + torch.cat((-x[..., 32:], x[..., :32]), -1) * s
    assert_close(rope_ref(x, pos, cos, sin), hf, what="twin vs HF")
    y = x.clone()
    rope(y, pos, cos, sin, out=y)
    assert_close(y, hf, what="in place")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1536, 100])
def test_silu_and_mul(dtype, n):
    x = torch.randn(5, 2 * n, dtype=dtype) * 3
    y = silu_and_mul(x)
    assert y.shape == (5, n)
    assert_close(y, silu_and_mul_ref(x), what="silu_and_mul")
