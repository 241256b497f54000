"""Triton dequantizing GEMV/GEMM and dequantize_to against their twins (interpreter).

Twin: quant_linear_ref = (x.float() @ dequantize(qw).T).to(x.dtype). Tolerances per output dtype: tolerances.py
(float32 1e-5; fp16 2 ulp; bf16 2 ulp because the interpreter truncates the final float32 -> bf16 cast).
"""
import pytest
import torch

from kernels.qlinear import dequantize_to, qlinear
from kernels.quant import dequantize, quantize
from kernels.reference import quant_linear_ref
from tests.kernels.tolerances import assert_close

WEIGHTS = [("int8", None), ("int8", 32), ("int4_asym", 32), ("int4_sym", 64), ("int4_asym", 128), ("ternary", 64),
           ("ternary", 128)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("fmt,group", WEIGHTS, ids=[f"{f}-g{g}" for f, g in WEIGHTS])
def test_decode_batches_all_formats(fmt, group):
    """Batch 1 (reduce path) and 2..8 (tl.dot path, padded to 16 rows); odd out_features; float32 activations."""
    n, k = 197, 384  # 197: not a multiple of any block
    qw = quantize(torch.randn(n, k) * 0.1, fmt, group)
    for b in (1, 2, 5, 8):
        x = torch.randn(b, k)
        assert_close(qlinear(x, qw), quant_linear_ref(x, qw), what=f"{fmt} g{group} batch {b}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", ["int8", "int4_asym", "int4_sym", "ternary"])
def test_half_activations(fmt, dtype):
    qw = quantize(torch.randn(96, 256) * 0.1, fmt)
    for b in (1, 3):
        x = torch.randn(b, 256, dtype=dtype)
        y = qlinear(x, qw)
        assert y.dtype == dtype
        assert_close(y, quant_linear_ref(x, qw), what=f"{fmt} {dtype} batch {b}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_tiles_and_leading_dims(dtype):
    """Many rows (several BLOCK_M tiles, ragged last tile), a 3-D input, a bias; in_features 1536 (K loop)."""
    qw = quantize(torch.randn(80, 1536) * 0.05, "int4_asym", 32)
    x = torch.randn(3, 47, 1536, dtype=dtype)
    bias = torch.randn(80, dtype=dtype)
    y = qlinear(x, qw, bias)
    assert y.shape == (3, 47, 80)
    assert_close(y, quant_linear_ref(x, qw, bias), what="prefill")


@pytest.mark.parametrize("fmt,group", WEIGHTS, ids=[f"{f}-g{g}" for f, g in WEIGHTS])
def test_dequantize_to_is_exact(fmt, group):
    qw = quantize(torch.randn(45, 256), fmt, group)
    for dtype in (torch.float32, torch.float16):
        # the same float32 products/sums as the twin, then one rounding (fp16 rounding is correct in the interpreter)
        assert torch.equal(dequantize_to(qw, dtype), dequantize(qw, dtype))
    # bf16: the interpreter truncates instead of rounding, so allow the last bit
    assert_close(dequantize_to(qw, torch.bfloat16), dequantize(qw, torch.bfloat16), what="bf16")


def test_shape_mismatch_raises():
    qw = quantize(torch.randn(16, 64), "int8")
    with pytest.raises(ValueError):
        qlinear(torch.randn(2, 32), qw)
    assert qlinear(torch.randn(0, 64), qw).shape == (0, 16)


def test_int8_with_mins_through_the_kernel():
    """int8 codes with a min per group (GGUF Q5_1 and Q5_K, engine/model/gguf_exact.py): the GEMV, the tile path and
    dequantize_to against the twin, for one group per row too (the per-channel shortcut must not drop the mins)."""
    from kernels.quant import QuantizedWeight
    for n, k, group in ((197, 384, 32), (64, 128, 128)):
        base = quantize(torch.randn(n, k) * 0.1, "int8", group)
        qw = QuantizedWeight("int8", base.qweight, base.scales, torch.randn(n, k // group) * 0.05, group, (n, k))
        for b in (1, 5):
            x = torch.randn(b, k)
            assert_close(qlinear(x, qw), quant_linear_ref(x, qw), what=f"int8+mins g{group} batch {b}")
        assert torch.equal(dequantize_to(qw, torch.float32), dequantize(qw))
