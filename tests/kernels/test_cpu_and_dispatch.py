"""The CPU paths of the quantized linear layer against the twin, and kernels.dispatch's choices.

CPU-path tolerances (max |y - twin| / max |twin|, and the same for the Frobenius norm):
* float32 compute (ATen op in float32, or dequantize + F.linear): 1e-5 (summation order only).
* bf16 compute (float32 activations rounded to bf16 for the ATen op, result rounded to bf16 and back): 1e-2 max,
  5e-3 norm: two roundings at 2^-9 relative each.
"""
import pytest
import torch

from kernels import cpu, dispatch
from kernels.quant import QuantizedWeight, quantize
from kernels.reference import (paged_decode_attention_ref, quant_linear_ref, rms_norm_ref, rope_ref, rope_tables,
                               silu_and_mul_ref)
from tests.kernels.tolerances import assert_close


def rel_err(y, ref):
    y, ref = y.float(), ref.float()
    return ((y - ref).abs().max() / ref.abs().max()).item(), ((y - ref).norm() / ref.norm()).item()


CPU_CASES = [("int8", None, cpu.int8pack_linear), ("int4_asym", 32, cpu.int4pack_linear),
             ("int4_sym", 64, cpu.int4pack_linear), ("ternary", 64, cpu.int4pack_linear),
             ("ternary", 128, cpu.int4pack_linear), ("int4_asym", 128, cpu.int4pack_linear)]


@pytest.mark.parametrize("fmt,group,fn", CPU_CASES, ids=[f"{c[0]}-g{c[1]}" for c in CPU_CASES])
def test_aten_cpu_paths_match_the_twin(fmt, group, fn):
    qw = quantize(torch.randn(192, 768) * 0.05, fmt, group)
    for b in (1, 4):
        x = torch.randn(b, 768)
        ref = quant_linear_ref(x, qw)
        mx, nrm = rel_err(fn(x, qw), ref)  # float32 compute
        assert mx < 1e-5 and nrm < 1e-5, (b, mx, nrm)
        y = fn(x, qw, torch.bfloat16)
        assert y.dtype == torch.float32
        mx, nrm = rel_err(y, ref)
        assert mx < 1e-2 and nrm < 5e-3, (b, mx, nrm)
    x = torch.randn(2, 3, 768, dtype=torch.bfloat16)  # native bf16 activations, leading dims
    mx, nrm = rel_err(fn(x, qw), quant_linear_ref(x, qw))
    assert mx < 1e-2 and nrm < 5e-3


@pytest.mark.parametrize("group,mins", [(32, False), (64, True), (128, False)])
def test_grouped_int8_as_two_int4_planes_and_the_dense_path_match_the_twin(group, mins, monkeypatch):
    """Grouped int8 (GGUF Q8_0, Q5_0; with mins Q5_1, Q5_K) through one int4pack call over its two 4-bit planes,
    and a group-16 weight through its cached dense bf16 copy: within the bf16 tolerance of the twin, with codes
    reaching -128 and 127. (The Triton kernel's int8 with mins: test_qlinear.)"""
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    qw = quantize(torch.randn(96, 512) * 0.05, "int8", group)
    qw.qweight[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)
    if mins:
        qw = QuantizedWeight("int8", qw.qweight, qw.scales.half(), (torch.randn(96, 512 // group) * 0.02).half(),
                             group, qw.shape)
    g16 = quantize(torch.randn(96, 512) * 0.05, "int8", 16)
    for weight, path in ((qw, "int8split"), (g16, "dense")):
        assert dispatch.cpu_linear_path(weight) == path
        for b in (1, 5):
            x = torch.randn(b, 512)
            y = dispatch.linear(x, weight)
            mx, nrm = rel_err(y, quant_linear_ref(x, weight))
            assert y.dtype == torch.float32 and mx < 1e-2 and nrm < 5e-3, (path, b, mx, nrm)


def test_dequant_path_matches_the_twin():
    for fmt, group in [("int8", 32), ("int4_asym", 32), ("ternary", 64)]:
        qw = quantize(torch.randn(40, 256), fmt, group)
        x = torch.randn(3, 256)
        mx, nrm = rel_err(cpu.dequant_linear(x, qw), quant_linear_ref(x, qw))
        assert mx < 1e-5 and nrm < 1e-5


def test_cpu_path_choice():
    bf16 = torch.bfloat16
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "int8")) == "int8pack"
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "int8", 32)) == "int8split"  # grouped (Q8_0)
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "int4_asym", 32)) == "int4pack"
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "ternary", 64)) == "int4pack"
    assert dispatch.cpu_linear_path(quantize(torch.randn(40, 128), "int4_sym", 32)) == "dense"  # N % 16
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "int4_sym", 16)) == "dense"  # group 16 (Q6_K)
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "int8", 16)) == "dense"
    # exact float32 compute requested: the ATen float32 kernels are slower than dequantize + F.linear
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "int8"), torch.float32, None) == "dequant"
    assert dispatch.cpu_linear_path(quantize(torch.randn(64, 128), "int8"), bf16, None) == "int8pack"


def test_use_triton(monkeypatch):
    assert dispatch.use_triton("cpu")  # TRITON_INTERPRET=1 (conftest)
    assert dispatch.use_triton(torch.device("cuda"))
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    assert not dispatch.use_triton("cpu") and not dispatch.use_triton("cuda")
    monkeypatch.setenv("NINFER_NO_TRITON", "0")
    assert dispatch.use_triton("cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not dispatch.use_triton("cpu") and dispatch.use_triton("cuda")


@pytest.mark.parametrize("route", ["triton", "cpu"])
def test_dispatch_functions(route, monkeypatch):
    if route == "cpu":
        monkeypatch.setenv("NINFER_NO_TRITON", "1")
    assert dispatch.use_triton("cpu") == (route == "triton")
    qw = quantize(torch.randn(64, 256) * 0.1, "int4_asym", 32)
    x = torch.randn(2, 256)
    bias = torch.randn(64)
    y = dispatch.linear(x, qw, bias)
    mx, nrm = rel_err(y, quant_linear_ref(x, qw, bias))
    assert mx < (1e-5 if route == "triton" else 1e-2), mx
    assert_close(dispatch.linear(x, qw, cpu_compute_dtype=None), quant_linear_ref(x, qw), what="exact linear")
    assert_close(dispatch.dequantize_to(qw, torch.float32), quant_linear_ref(torch.eye(256), qw).T, what="deq")

    h = torch.randn(3, 128)
    w = torch.rand(128)
    assert_close(dispatch.rms_norm(h, w, 1e-5), rms_norm_ref(h, w, 1e-5), what="rms")
    out, res = dispatch.rms_norm(h, w, 1e-5, residual=h)
    assert_close(out, rms_norm_ref(h, w, 1e-5, residual=h)[0], what="rms+res")
    cos, sin = rope_tables(64, 10000.0, 32)
    t = torch.randn(3, 2, 64)
    pos = torch.tensor([1, 2, 31])
    assert_close(dispatch.rope(t, pos, cos, sin), rope_ref(t, pos, cos, sin), what="rope")
    g = torch.randn(3, 64)
    assert_close(dispatch.silu_and_mul(g), silu_and_mul_ref(g), what="silu")
    q, kc, vc = torch.randn(2, 4, 64), torch.randn(4, 64, 2, 64), torch.randn(4, 64, 2, 64)
    table, lens = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32), torch.tensor([70, 64], dtype=torch.int32)
    assert_close(dispatch.paged_decode_attention(q, kc, vc, table, lens),
                 paged_decode_attention_ref(q, kc, vc, table, lens), what="attention")
