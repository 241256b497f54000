"""Weight formats: packing, quantize/dequantize round trips (error bounds per format). GGUF block repacking is
tested in test_quant_gguf.py: this file needs torch alone, as scripts/gpu_check.sh runs it on a GPU machine."""
import pytest
import torch

from kernels.quant import (FORMATS, QuantizedWeight, codes, dequantize, pack_int4, pack_ternary, quantize,
                           quantize_int4, quantize_int8, quantize_ternary, unpack_int4, unpack_ternary)


def test_pack_unpack_round_trip():
    c4 = torch.randint(0, 16, (7, 96), dtype=torch.uint8)
    p4 = pack_int4(c4)
    assert p4.shape == (7, 48) and torch.equal(unpack_int4(p4), c4)
    assert p4[0, 0] == c4[0, 0] | (c4[0, 1] << 4)  # element 2j low nibble, 2j+1 high nibble
    c2 = torch.randint(0, 4, (5, 64), dtype=torch.uint8)
    p2 = pack_ternary(c2)
    assert p2.shape == (5, 16) and torch.equal(unpack_ternary(p2), c2)
    assert p2[1, 3] == c2[1, 12] | (c2[1, 13] << 2) | (c2[1, 14] << 4) | (c2[1, 15] << 6)


@pytest.mark.parametrize("shape", [(64, 576), (33, 96)])
def test_int8_per_channel_round_trip(shape):
    w = torch.randn(shape) * torch.rand(shape[0], 1)  # rows of different scale
    qw = quantize_int8(w)
    assert qw.group_size == shape[1] and qw.scales.shape == (shape[0], 1) and qw.qweight.dtype == torch.int8
    err = (dequantize(qw) - w).abs()
    # round to nearest: at most half a step (scale) per element, plus float32 rounding
    assert (err <= qw.scales.float() * (0.5 + 1e-5) + 1e-7).all()
    assert err.norm() / w.norm() < 1e-2  # "int8 relative error small": ~0.5% for Gaussian rows


def test_int8_grouped_round_trip():
    w = torch.randn(16, 256)
    qw = quantize_int8(w, group_size=32)
    step = qw.scales.float().repeat_interleave(32, dim=1)
    assert ((dequantize(qw) - w).abs() <= step * (0.5 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_asym_round_trip(group):
    w = torch.randn(24, 384) * 0.02 + 0.003
    qw = quantize_int4(w, group, symmetric=False)
    assert qw.format == "int4_asym" and qw.qweight.shape == (24, 192) and qw.scales.dtype == torch.float16
    d = qw.scales.float().repeat_interleave(group, 1)
    m = qw.mins.float().repeat_interleave(group, 1)
    err = (dequantize(qw) - w).abs()
    # half a step, plus what storing d and m in fp16 (2^-11 relative) can move the top of the range
    assert (err <= 0.5 * d + 16 * d * 2 ** -11 + m.abs() * 2 ** -10 + 1e-7).all()
    assert codes(qw).max() == 15 and codes(qw).min() == 0


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_sym_round_trip(group):
    w = torch.randn(24, 384)
    qw = quantize_int4(w, group, symmetric=True)
    assert qw.format == "int4_sym" and qw.mins is None
    d = qw.scales.float().abs().repeat_interleave(group, 1)
    err = (dequantize(qw) - w).abs()
    # GGUF Q4_0 convention: the largest-magnitude value maps to -8 steps, so the opposite end may clip by one step
    assert (err <= d * (1 + 1e-3) + 1e-7).all()
    assert (err <= 0.5 * d * (1 + 1e-3) + 1e-7).float().mean() > 0.95


@pytest.mark.parametrize("group", [64, 128])
def test_ternary_round_trip(group):
    w = torch.randn(16, 512)
    qw = quantize_ternary(w, group)
    assert qw.qweight.shape == (16, 128) and set(codes(qw).unique().tolist()) <= {0, 1, 2}
    s = qw.scales.float().repeat_interleave(group, 1)
    expect_s = w.abs().reshape(16, -1, group).mean(-1).repeat_interleave(group, 1)
    assert torch.allclose(s, expect_s, rtol=2 ** -10)
    t = torch.round((w / s).clamp(-1, 1))
    assert torch.equal(dequantize(qw), t * s)  # the definition, exactly
    err = (dequantize(qw) - w).abs()
    # inside [-s, s]: half a step; outside: the clip
    assert (err <= torch.maximum(0.5 * s, w.abs() - s) * (1 + 1e-6) + 1e-7).all()


def test_quantize_entry_point_and_sizes():
    w = torch.randn(32, 256)
    for fmt in FORMATS:
        qw = quantize(w, fmt)
        assert qw.format == fmt and qw.shape == (32, 256) and dequantize(qw).shape == (32, 256)
    assert quantize(w, "int4_asym").nbytes == 32 * 256 // 2 + 2 * 2 * 32 * 8  # 5 bits per weight
    assert quantize(w, "ternary", 128).nbytes == 32 * 256 // 4 + 2 * 32 * 2
    with pytest.raises(ValueError):
        quantize(w, "int3")


def test_zero_rows_and_dtype():
    w = torch.zeros(16, 64)
    for fmt in FORMATS:
        d = dequantize(quantize(w, fmt), torch.bfloat16)
        assert d.dtype == torch.bfloat16 and torch.equal(d.float(), w)


def test_validation():
    q = torch.zeros(4, 32, dtype=torch.uint8)
    s = torch.ones(4, 2, dtype=torch.float16)
    QuantizedWeight("int4_sym", q, s, None, 32, (4, 64))
    with pytest.raises(ValueError):
        QuantizedWeight("int4_sym", q, s, None, 32, (4, 66))  # group does not divide
    with pytest.raises(ValueError):
        QuantizedWeight("int4_asym", q, s, None, 32, (4, 64))  # mins missing
    with pytest.raises(ValueError):
        QuantizedWeight("int8", q, s, None, 32, (4, 64))  # wrong qweight dtype/shape
    with pytest.raises(ValueError):
        QuantizedWeight("ternary", q, s, None, 32, (4, 64))  # ternary packs 4 per byte
