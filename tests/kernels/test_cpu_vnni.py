"""The low-bit GEMV's code paths (kernels/cpu_native.py: gemv_paths; kernels/cpu_vnni.cpp: the AVX-512 VNNI one):
each path's integer products exact, each against the twin as tests/kernels/test_cpu_native.py states it, and the
paths against each other within float32's summation bound. A machine without AVX-512 VNNI runs the AVX2 path's
cases only (the others are skipped, saying so)."""
import pytest
import torch

from kernels import cpu_native
from kernels.quant import QuantizedWeight, dequantize, pack_int4
from kernels.reference import lowbit_linear_ref, quant_linear_ref
from tests.kernels import test_cpu_native as base

PATHS = list(cpu_native.GEMV_PATHS)


@pytest.fixture(params=PATHS)
def path(request, cpp_kernels):
    """Each code path in turn; a path this build lacks is skipped."""
    if request.param not in cpu_native.gemv_paths():
        pytest.skip(f"this CPU's build has no {request.param} path (it has {', '.join(cpu_native.gemv_paths())})")
    with cpu_native.gemv_path(request.param):
        yield request.param


def exact_case(fmt: str, out: int, k: int, group: int, scale_dtype, rows: int, seed: int):
    """Operands whose every product and partial sum float32 holds exactly: power-of-two scales and mins (2^-6 ..
    2^-8), x of whole multiples of 2^-10 in [-8, 8] x 2^-10 but one value a block at +-32767 x 2^-10 (so the step is
    2^-10 and the int16 rounding is exact), the code at that value 0. The result is then the integer sums times the
    scales, with nothing rounded: the kernel must give it bit for bit."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    four = fmt.startswith("int4")
    c = torch.randint(0, 16, (out, k), generator=g) if four else torch.randint(-128, 128, (out, k), generator=g)
    q = torch.randint(-8, 9, (rows, k), generator=g).float()
    big = torch.randint(0, 32, (k // 32,), generator=g) + torch.arange(0, k, 32)  # one place a block, every row
    q[:, big] = 32767 * (torch.randint(0, 2, (rows, k // 32), generator=g).float() * 2 - 1)
    c[:, big] = 0
    x = q * 2.0 ** -10
    pow2 = lambda: (2.0 ** -torch.randint(6, 9, (out, groups), generator=g).float()).to(scale_dtype)  # noqa: E731
    d = pow2()
    m = -pow2() if fmt in ("int4_asym", "int8_mins") else None
    codes = pack_int4(c) if four else c.to(torch.int8)
    return x, QuantizedWeight("int8" if not four else fmt, codes, d, m, group, (out, k))


@pytest.mark.parametrize("fmt,out,k,group,scale_dtype", [
    ("int4_asym", 67, 1024, 32, torch.float16), ("int4_sym", 64, 96, 32, torch.float16),
    ("int4_asym", 40, 288, 32, torch.float32), ("int4_sym", 33, 1024, 128, torch.float16),
    ("int8", 67, 1024, 32, torch.float16), ("int8_mins", 50, 288, 32, torch.float32),
    ("int8", 31, 1024, 64, torch.float32), ("int4_asym", 16, 640, 64, torch.float16)])
def test_each_path_gives_the_integer_products_exactly(path, fmt, out, k, group, scale_dtype):
    """Odd and even counts of blocks (96: 3, 288: 9), groups of 32 (read 8 blocks at a time) and 64 / 128 (the per-row
    table), mins, symmetric 4-bit, float16 and float32 scales, every row count a decode step brings: equal to the
    exact product (float64, which here float32 holds) bit for bit."""
    for rows in (1, 2, 3, 4, 5, 11):
        x, qw = exact_case(fmt, out, k, group, scale_dtype, rows, seed=out + k + rows)
        assert cpu_native.lowbit_supported(qw)
        exact = (x.double() @ dequantize(qw, torch.float64).T)
        assert bool((exact.float().double() == exact).all())  # the case is what it says: float32 holds the result
        got = cpu_native.lowbit_linear(x, qw)
        assert torch.equal(got, exact.float()), (path, rows, (got.double() - exact).abs().max().item())


@pytest.mark.parametrize("fmt,out,k,group,scale_dtype", [
    ("int4_asym", 1000, 576, 32, torch.float16), ("int4_sym", 77, 96, 32, torch.float16),
    ("int4_asym", 49, 1536, 64, torch.float32), ("int8", 1000, 256, 32, torch.float32),
    ("int8_mins", 77, 576, 32, torch.float16), ("int8", 49, 288, 288, torch.float32)])
def test_each_path_equals_the_twin_for_every_row_count(path, fmt, out, k, group, scale_dtype):
    """test_cpu_native's twin test (within 2e-5 of the twin, and the rounding's bound to the exact product) on each
    path."""
    base.test_lowbit_linear_equals_its_twin_for_every_row_count(None, fmt, out, k, group, scale_dtype)


@pytest.mark.parametrize("out,k,group,mins", [(1000, 256, 32, False), (77, 576, 64, True)])
def test_each_path_keeps_the_output_layer_exact(path, out, k, group, mins):
    """q8_linear (twice-rounded rows through the same GEMV) within 1e-5 of the float32 matmul, and beside an
    outlier within 1e-6 of the exact product, on each path."""
    base.test_q8_linear_equals_the_float32_matmul_for_every_row_count(None, out, k, group, mins)
    base.test_q8_linear_keeps_float32_precision_beside_an_outlier(None)


@pytest.mark.parametrize("fmt,group", [("int4_asym", 32), ("int4_sym", 32), ("int8", 32), ("int8_mins", 64)])
def test_the_paths_differ_only_by_float32_summation(cpp_kernels, fmt, group):
    """Random operands at a decode layer's size: the same integer sums, so the paths differ by no more than two float32
    summations of the blocks' terms can: 2 x blocks x 2^-24 x the sum of the terms' magnitudes (stated bound)."""
    if len(cpu_native.gemv_paths()) < 2:
        pytest.skip(f"this CPU's build has one GEMV path ({cpu_native.gemv_paths()[0]})")
    k = 4096
    qw = base.lowbit(fmt, 512, k, group)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(11)) * 3
    got = {}
    for name in cpu_native.gemv_paths():
        with cpu_native.gemv_path(name):
            got[name] = cpu_native.lowbit_linear(x, qw).double()
    w = dequantize(qw, torch.float64)
    m = qw.mins.double() if qw.mins is not None else -8 * qw.scales.double() if fmt == "int4_sym" else None
    mpart = torch.zeros_like(w) if m is None else m.repeat_interleave(group, 1)
    terms = 1.01 * x.abs().double() @ ((w - mpart).abs() + mpart.abs()).T  # >= the sum of the blocks' |terms|
    bound = 2 * (k // 32 + 4) * 2.0 ** -24 * terms
    a, b = got.values()
    assert bool(((a - b).abs() <= bound).all()), ((a - b).abs() / bound).max().item()
    twin = lowbit_linear_ref(x, qw).double()
    for y in got.values():
        assert ((y - twin).abs().max() <= 2e-5 * twin.abs().max()).item()


def test_a_path_is_switched_for_a_block_and_restored(cpp_kernels):
    paths = cpu_native.gemv_paths()
    assert paths[0] == "avx2" and set(paths) <= set(cpu_native.GEMV_PATHS)
    widest = cpu_native._state["gemv_isa"](-1)
    assert widest == len(paths) - 1  # the default is the widest path built
    with cpu_native.gemv_path("avx2"):
        assert cpu_native._state["gemv_isa"](-1) == 0
    assert cpu_native._state["gemv_isa"](-1) == widest
    with pytest.raises(ValueError, match="not in this build|has"):
        cpu_native.gemv_path("avx1024")
    x, qw = exact_case("int4_asym", 8, 64, 32, torch.float16, 1, seed=0)
    torch.testing.assert_close(cpu_native.lowbit_linear(x, qw), quant_linear_ref(x, qw), rtol=0, atol=0)
