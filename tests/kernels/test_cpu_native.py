"""The C++ CPU kernel (kernels/cpu_native.py) against its twin, the float32 matmul over the dequantized weight; the
output layer's kernel choosing it where it builds and the compiled kernel where it does not."""
import pytest
import torch

from kernels import cpu_compiled, cpu_native
from kernels.quant import QuantizedWeight, quantize_int4
from kernels.reference import quant_linear_ref
from tests.kernels.test_cpu_compiled import grouped


@pytest.fixture(scope="module")
def native():
    why = cpu_native.ready()
    assert why is None, why  # this machine has a C++ compiler and ninja (the project's dependencies)


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
