"""The C++ CPU kernels (kernels/cpu_native.py) against their twins: q8_linear against the float32 matmul over the
dequantized weight, the output layer's kernel choosing it where it builds and the compiled kernel where it does not;
lowbit_linear against reference.lowbit_linear_ref and the rounding's bound, and the dispatch of marked weights."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu, cpu_compiled, cpu_native, dispatch
from kernels.quant import QuantizedWeight, dequantize, quantize, quantize_int4
from kernels.reference import int16_rows, lowbit_linear_ref, quant_linear_ref
from tests.kernels.test_cpu_compiled import grouped


@pytest.fixture(scope="module")
def native(cpp_kernels):
    """The kernels built (tests/conftest.py: a C++ compiler and ninja come with the project's dependencies)."""


@pytest.mark.parametrize("out,k,group,mins", [(1000, 256, 32, False), (1000, 256, 32, True), (77, 576, 64, True),
                                               (49, 1536, 256, False)])
def test_q8_linear_equals_the_float32_matmul_for_every_row_count(native, out, k, group, mins):
    """Output counts that are not a multiple of the threads' share, every row count a decode or verification step
    brings (several passes of four rows and the rest one by one), groups of 32 to 256, with and without mins."""
    qw = grouped(out, k, group, mins)
    assert cpu_native.supported(qw)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(out)) * 3
    want = quant_linear_ref(x, qw)
    for rows in (1, 2, 3, 4, 5, 8, 11):
        got = cpu_native.q8_linear(x[:rows], qw)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        torch.testing.assert_close(got, want[:rows], rtol=1e-5, atol=1e-5 * want.abs().max().item())
    strided = x[:3, :].t().contiguous().t()  # the same rows, not contiguous
    torch.testing.assert_close(cpu_native.q8_linear(strided, qw), want[:3], rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())


def test_q8_linear_keeps_float32_precision_beside_an_outlier(native):
    """A hidden state with one large value (as real ones have): one int16 rounding per block would leave the output
    layer's logits ~1e-5 of the largest from the exact products; the twice-rounded rows must stay within 1e-6, as
    close as a float32 matmul over the dequantized weight."""
    qw = grouped(4096, 576, 32, False)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(7))
    x[:, 5] = 60.0
    exact = x.double() @ dequantize(qw, torch.float64).T
    scale = exact.abs().max().item()
    got = cpu_native.q8_linear(x, qw).double()
    dense = (x @ dequantize(qw, torch.float32).T).double()
    assert (got - exact).abs().max().item() <= max(1e-6 * scale, 2 * (dense - exact).abs().max().item())
    once = lowbit_linear_ref(x, qw).double()  # what a single rounding gives: the bound above must be meaningful
    assert (once - exact).abs().max().item() > 2e-6 * scale


def test_q8_linear_refuses_what_it_cannot_read(native):
    qw = grouped(64, 64, 32, False)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_native.q8_linear(torch.randn(1, 64).half(), qw)
    with pytest.raises(RuntimeError, match="disagree"):
        cpu_native.q8_linear(torch.randn(1, 32), qw)
    assert not cpu_native.supported(grouped(64, 64, 16, False))  # groups of 16: the compiled kernel takes them
    assert not cpu_native.supported(quantize_int4(torch.randn(64, 64), 32))


def test_the_output_layer_kernel_takes_the_cpp_kernel_where_it_builds(native, monkeypatch):
    """cpu_compiled.exact_linear's rows go through the C++ kernel once `ready` found it (no torch.compile then), and
    through the compiled one-row loop where it is not available: the same products either way."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    qw = grouped(1000, 256, 32, True)
    assert cpu_compiled.ready(qw) is None and qw.cache["native"] is True
    calls = []
    monkeypatch.setattr(cpu_native, "q8_linear", lambda x, w: calls.append(x.shape[0]) or quant_linear_ref(x, w))
    cpu_compiled.exact_linear(x, qw)
    assert calls == [3]
    monkeypatch.undo()

    monkeypatch.setattr(cpu_native, "_state", {"error": "no C++ kernel in this test"})
    other = QuantizedWeight("int8", qw.qweight, qw.scales, qw.mins, 32, qw.shape)
    assert cpu_compiled.ready(other) is None and other.cache["native"] is False
    want = quant_linear_ref(x, qw)
    torch.testing.assert_close(cpu_compiled.exact_linear(x, other), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())


def test_a_build_is_kept_per_cpu(monkeypatch):
    """Another CPU's features name another folder: a build made for one CPU is never loaded on another."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/cache/inductor")
    source = cpu_native._source()
    here = cpu_native.build_key(source)
    assert cpu_native.build_dir(here) == f"/cache/cpu_native/{here}"
    monkeypatch.setattr(cpu_native, "_cpu_features", lambda: "flags : fpu sse sse2")
    assert cpu_native.build_key(source) != here
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cpu_native.build_dir(here) is None  # torch's extensions folder, the key in the build's name


def test_the_build_key_reads_every_source_and_the_header(tmp_path, monkeypatch):
    """A change to any translation unit or to cpu_kernels.h is another build; every .cpp and .h of kernels/ is built."""
    import glob
    import os
    import shutil

    here = os.path.dirname(cpu_native.__file__)
    assert sorted(cpu_native.SOURCES) == sorted(glob.glob(os.path.join(here, "*.cpp")))
    assert sorted(cpu_native.HEADERS) == sorted(glob.glob(os.path.join(here, "*.h")))
    key = cpu_native.build_key(cpu_native._source())
    for path in cpu_native.SOURCES + cpu_native.HEADERS:
        copy = tmp_path / os.path.basename(path)
        shutil.copyfile(path, copy)
        with open(copy, "a") as f:
            f.write("\n// changed\n")
        swapped = [str(copy) if p == path else p for p in cpu_native.SOURCES + cpu_native.HEADERS]
        monkeypatch.setattr(cpu_native, "SOURCES", [p for p in swapped if p.endswith(".cpp")])
        monkeypatch.setattr(cpu_native, "HEADERS", [p for p in swapped if p.endswith(".h")])
        assert cpu_native.build_key(cpu_native._source()) != key, path
        monkeypatch.undo()


# ---------------------------------------------------------------------------------------------------- lowbit_linear
def lowbit(fmt: str, out: int, k: int, group: int, scale_dtype=torch.float16) -> QuantizedWeight:
    """A weight of each format the kernel reads, scales in `scale_dtype` (float16 as GGUF files store them)."""
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(out * 7 + k + group))
    if fmt in ("int4_asym", "int4_sym"):
        return quantize_int4(w, group, symmetric=fmt == "int4_sym", scale_dtype=scale_dtype)
    qw = grouped(out, k, group, mins=fmt == "int8_mins")
    return QuantizedWeight("int8", qw.qweight, qw.scales.to(scale_dtype),
                           None if qw.mins is None else qw.mins.to(scale_dtype), group, qw.shape)


@pytest.mark.parametrize("fmt,out,k,group,scale_dtype", [
    ("int4_asym", 1000, 576, 32, torch.float16), ("int4_sym", 77, 96, 32, torch.float16),
    ("int4_asym", 49, 1536, 64, torch.float32), ("int8", 1000, 256, 32, torch.float32),
    ("int8_mins", 77, 576, 32, torch.float16), ("int8", 49, 288, 288, torch.float32)])
def test_lowbit_linear_equals_its_twin_for_every_row_count(native, fmt, out, k, group, scale_dtype):
    """Q4_1- and Q4_0-like 4-bit weights, grouped int8 with and without mins (Q8_0, Q5_*), per-channel int8; float16
    and float32 scales; an odd number of blocks of 32 (k = 96, 288); every row count a decode or verification step
    brings. The twin rounds the activations the same way, so only the summation order differs; against the exact
    float32 product the error stays within the rounding's bound."""
    qw = lowbit(fmt, out, k, group, scale_dtype)
    assert cpu_native.lowbit_supported(qw)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(out)) * 3
    x[2, :32] *= 100  # a block with an outlier: its step is 100x coarser, the other blocks' are not
    want, exact = lowbit_linear_ref(x, qw), quant_linear_ref(x, qw)
    for rows in (1, 2, 3, 4, 5, 8, 11):
        got = cpu_native.lowbit_linear(x[:rows], qw)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        torch.testing.assert_close(got, want[:rows], rtol=2e-5, atol=2e-5 * want.abs().max().item())
    # the rounding's bound: each value within half a step (max|x| of its block / 32767) of x, and float32 products
    err = (int16_rows(x) - x).abs().view(11, -1, 32)
    assert bool((err <= x.abs().view(11, -1, 32).amax(-1, keepdim=True) / 65534 * 1.02).all())
    m = qw.mins.float() if qw.mins is not None else -8 * qw.scales.float() if qw.format == "int4_sym" else 0
    codes_part = (dequantize(qw) - (m.repeat_interleave(group, 1) if torch.is_tensor(m) else 0)).abs()
    bound = (err.view(11, k) @ codes_part.T) * 1.01 + 1e-5 * exact.abs().max()
    assert bool(((cpu_native.lowbit_linear(x, qw) - exact).abs() <= bound).all())
    strided = x[:3].t().contiguous().t()
    torch.testing.assert_close(cpu_native.lowbit_linear(strided, qw), want[:3], rtol=2e-5,
                               atol=2e-5 * want.abs().max().item())


def test_lowbit_linear_is_more_precise_than_the_bf16_path(native):
    """ATen's int4 kernel takes bf16 activations and bf16 scales; the C++ kernel rounds activations to int16 per
    block and reads the scales as stored: on a Q4_1-like layer its error to the exact product is far smaller."""
    qw = lowbit("int4_asym", 1024, 576, 32)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(3))
    exact = quant_linear_ref(x, qw)
    rel = lambda y: ((y - exact).norm() / exact.norm()).item()  # noqa: E731
    aten = cpu.int4pack_linear(x, qw, torch.bfloat16)  # what an unmarked weight runs on the CPU
    assert rel(cpu_native.lowbit_linear(x, qw)) < rel(aten) / 10


def test_lowbit_linear_refuses_what_it_cannot_read(native):
    qw = lowbit("int4_asym", 64, 64, 32)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_native.lowbit_linear(torch.randn(1, 64).half(), qw)
    with pytest.raises(RuntimeError, match="disagree"):
        cpu_native.lowbit_linear(torch.randn(1, 32), qw)
    assert not cpu_native.lowbit_supported(quantize_int4(torch.randn(64, 64), 16))  # groups of 16 (Q6_K-like)
    assert not cpu_native.lowbit_supported(quantize(torch.randn(64, 64), "ternary"))
    assert not cpu_native.lowbit_supported(quantize_int4(torch.randn(4, 2 * cpu_native.LOWBIT_MAX_IN), 32))


def test_marked_weights_decode_through_the_kernel_and_prompts_through_aten(native, monkeypatch):
    """A weight the engine marked takes the C++ kernel for up to NATIVE_ROWS rows and ATen's path for more; an
    unmarked one never takes it."""
    monkeypatch.setenv("NINFER_NO_TRITON", "1")  # the CPU paths, not the Triton interpreter the suite runs
    marked, plain = lowbit("int4_asym", 64, 128, 32), lowbit("int4_asym", 64, 128, 32)
    marked.cache["lowbit_native"] = True
    calls = []
    real = cpu_native.lowbit_op()
    monkeypatch.setattr(cpu_native, "lowbit_op", lambda: lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    x = torch.randn(cpu.NATIVE_ROWS + 1, 128, generator=torch.Generator().manual_seed(2))
    for rows in (1, cpu.NATIVE_ROWS, cpu.NATIVE_ROWS + 1):
        torch.testing.assert_close(dispatch.linear(x[:rows], marked), lowbit_linear_ref(x[:rows], marked),
                                   rtol=0.02, atol=0.02 * quant_linear_ref(x, marked).abs().max().item())
        dispatch.linear(x[:rows], plain)
    assert calls == [1, cpu.NATIVE_ROWS]
    y3 = dispatch.linear(x[:4].view(2, 2, 128), marked)  # [B, T, K] rows, as a verification step may bring
    assert y3.shape == (2, 2, 64) and calls[-1] == 4


def test_rms_norm_equals_atens(native):
    """Rows of every decode step (one, a few, [T, H, D] heads), an odd width, a huge and a zero row."""
    g = torch.Generator().manual_seed(4)
    for shape in ((1, 576), (5, 96), (3, 4, 64), (2, 33)):
        x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
        x.view(-1, shape[-1])[0] *= 1e4
        if x.shape[0] > 1:
            x.view(-1, shape[-1])[1] = 0
        got = cpu_native.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-6), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_native.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6)


@pytest.mark.parametrize("fmt,group,scale_dtype", [("int4_asym", 32, torch.float16), ("int4_sym", 32, torch.float16),
                                                   ("int4_asym", 64, torch.float32), ("int8", 32, torch.float32),
                                                   ("int8", 128, torch.float32)])
def test_dequantize_into_gives_exactly_the_weight_quant_dequantize_gives(native, fmt, group, scale_dtype):
    """The dense prompt path's dequantization (one C++ pass) must be bit-identical to kernels.quant.dequantize: the
    prompt's matmul then multiplies exactly the weight the file gives."""
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(group)) * 0.1
    qw = quantize(w, fmt, group)
    qw = QuantizedWeight(qw.format, qw.qweight, qw.scales.to(scale_dtype),
                         None if qw.mins is None else qw.mins.to(scale_dtype), qw.group_size, qw.shape)
    assert cpu_native.lowbit_supported(qw)
    out = torch.full(qw.shape, float("nan"))
    assert cpu_native.dequantize_into(qw, out) is out
    assert torch.equal(out, dequantize(qw, torch.float32))
    half = torch.full(qw.shape, float("nan"), dtype=torch.bfloat16)  # rounded in the pass, as .to() rounds
    assert cpu_native.dequantize_into(qw, half) is half
    assert torch.equal(half.view(torch.int16), dequantize(qw, torch.float32).to(torch.bfloat16).view(torch.int16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_native.dequantize_into(qw, torch.empty(qw.shape, dtype=torch.float64))


def test_dense_prompts_dequantize_through_the_cpp_pass(native, monkeypatch):
    from engine.model.linear import DenseScratch

    calls = []
    real = cpu_native.dequantize_into
    monkeypatch.setattr(cpu_native, "dequantize_into", lambda qw, out: calls.append(qw.shape) or real(qw, out))
    monkeypatch.setattr(dispatch, "use_triton", lambda device: False)  # as without TRITON_INTERPRET (the suite sets it)
    qw = quantize(torch.randn(64, 128), "int4_sym", 32)
    scratch = DenseScratch(min_rows=4)
    assert torch.equal(scratch.weight(qw, torch.float32), dequantize(qw, torch.float32)) and calls == [(64, 128)]
    assert torch.equal(scratch.weight(qw, torch.bfloat16), dequantize(qw, torch.float32).to(torch.bfloat16))
    assert calls == [(64, 128)] * 2  # one pass, straight into the bf16 buffer


@pytest.mark.parametrize("out,k,bias", [(1552, 512, False), (77, 576, True), (33, 100, True), (512, 1536, False)])
def test_dense_linear_equals_the_float64_matmul_for_every_row_count(native, out, k, bias):
    """Row counts of several four-row passes and the rest, output counts that are not a multiple of the threads'
    share or of the kernel's four weight rows, a width that is not a multiple of 8 (the plain loop), a bias."""
    g = torch.Generator().manual_seed(out)
    w, x = torch.randn(out, k, generator=g), torch.randn(16, k, generator=g) * 3
    b = torch.randn(out, generator=g) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    for rows in (1, 2, 4, 5, 9, 16):
        got = cpu_native.dense_linear(x[:rows], w, b)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        assert ((got.double() - want[:rows]).abs().max() / want[:rows].abs().max()) < 2e-6
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_native.dense_linear(x, w.t().contiguous().t(), None)


def test_float32_weights_decode_through_the_dense_kernel(native, monkeypatch):
    """use_cpu_kernel marks a dense float32 model's linears (the output layer's too): decode rows take the C++ GEMV,
    a prompt's rows ATen's matmul; both give the float32 product."""
    from engine.model.linear import Linear, use_cpu_kernel

    class Layer:
        def __init__(self):
            self.proj = Linear(torch.randn(96, 64))

    class Model:
        layers = [Layer(), Layer()]
        lm_head = Linear(torch.randn(300, 64))

    model = Model()
    assert use_cpu_kernel(model) == "3 float32 weights through the C++ GEMV"
    calls = []
    real = cpu_native.dense_linear
    monkeypatch.setattr(cpu_native, "dense_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    lin = model.layers[0].proj
    for rows in (1, 3, 100):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x), x @ lin.weight.t(), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3]
