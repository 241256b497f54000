"""GGUF block repacking: our repacked blocks dequantize bit-exactly as gguf.quants.dequantize does, and go through
the low-bit kernel (CPU only: the gguf package works on numpy arrays)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.qlinear import qlinear
from kernels.quant import dequantize, from_gguf, from_gguf_q4_0, from_gguf_q4_1, from_gguf_q8_0, from_gguf_tq2_0
from kernels.reference import quant_linear_ref
from tests.kernels.tolerances import assert_close

GGUF = [("Q4_0", from_gguf_q4_0, "int4_sym", 32), ("Q4_1", from_gguf_q4_1, "int4_asym", 32),
        ("Q8_0", from_gguf_q8_0, "int8", 32), ("TQ2_0", from_gguf_tq2_0, "ternary", 256)]


@pytest.mark.parametrize("name,fn,fmt,group", GGUF, ids=[g[0] for g in GGUF])
@pytest.mark.parametrize("rows,cols", [(5, 512), (3, 768)])
def test_gguf_repack_equals_gguf_dequantize(name, fn, fmt, group, rows, cols):
    qtype = getattr(GGMLQuantizationType, name)
    w = (torch.randn(rows, cols) * torch.rand(rows, 1) * 0.1).numpy()
    if name == "TQ2_0":  # a ternary-ish weight so that all three codes occur
        w = np.sign(w) * (np.abs(w) > 0.03) * 0.05
    raw = quants.quantize(w.astype(np.float32), qtype)
    ref = torch.from_numpy(quants.dequantize(raw, qtype))
    qw = fn(torch.from_numpy(raw), (rows, cols))
    assert qw.format == fmt and qw.group_size == group and qw.shape == (rows, cols)
    assert torch.equal(dequantize(qw), ref)
    assert torch.equal(dequantize(from_gguf(torch.from_numpy(raw), name, (rows, cols))), ref)


@pytest.mark.parametrize("name,fn,fmt,group", GGUF, ids=[g[0] for g in GGUF])
def test_gguf_repack_every_bit_pattern(name, fn, fmt, group):
    """Random code bytes (patterns gguf's quantizer never writes, e.g. TQ2_0 code 3) with finite fp16 scales."""
    qtype = getattr(GGMLQuantizationType, name)
    block, nbytes = quants.GGML_QUANT_SIZES[qtype]
    rows, nb = 4, 3
    raw = torch.randint(0, 256, (rows, nb, nbytes), dtype=torch.uint8)
    scales = (torch.randn(rows, nb, 2) * 0.01).half().view(torch.uint8).reshape(rows, nb, 2, 2)
    if name == "TQ2_0":
        raw[..., 64:66] = scales[..., 0, :]
    else:
        raw[..., 0:2] = scales[..., 0, :]
        if name == "Q4_1":
            raw[..., 2:4] = scales[..., 1, :]
    raw = raw.reshape(rows, nb * nbytes)
    ref = torch.from_numpy(quants.dequantize(raw.numpy(), qtype))
    assert torch.equal(dequantize(fn(raw, (rows, nb * block))), ref)


def test_gguf_rejects_wrong_sizes():
    with pytest.raises(ValueError):
        from_gguf_q4_1(torch.zeros(2, 39, dtype=torch.uint8), (2, 64))
    with pytest.raises(ValueError):
        from_gguf_q4_0(torch.zeros(2, 18, dtype=torch.uint8), (2, 48))
    with pytest.raises(ValueError):
        from_gguf(torch.zeros(2, 18, dtype=torch.uint8), "Q5_K", (2, 32))


def test_gguf_weight_through_the_kernel():
    w = torch.randn(48, 256).numpy()
    raw = torch.from_numpy(quants.quantize(w, GGMLQuantizationType.Q4_1))
    qw = from_gguf_q4_1(raw, (48, 256))
    x = torch.randn(4, 256)
    assert_close(qlinear(x, qw), quant_linear_ref(x, qw), what="Q4_1")
