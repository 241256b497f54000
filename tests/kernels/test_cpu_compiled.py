"""The compiled CPU output-layer kernel (kernels/cpu_compiled.py) against its twin, the float32 matmul over the
dequantized weight; the fallback where no C++ compiler exists."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels import cpu_compiled
from kernels.quant import QuantizedWeight, dequantize, quantize_int4, quantize_int8
from kernels.reference import quant_linear_ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def grouped(out: int, k: int, group: int, mins: bool) -> QuantizedWeight:
    g = torch.Generator().manual_seed(out + group)
    c = torch.randint(-128, 128, (out, k), dtype=torch.int8, generator=g)
    d = torch.rand(out, k // group, generator=g) * 0.02
    m = (torch.rand(out, k // group, generator=g) - 0.5) * 0.1 if mins else None
    return QuantizedWeight("int8", c, d, m, group, (out, k))


@pytest.mark.parametrize("mins", [False, True])
def test_exact_linear_equals_the_float32_matmul_for_every_row_count(mins):
    qw = grouped(1000, 256, 32 if mins else 16, mins)
    assert cpu_compiled.ready(qw) is None
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)) * 3
    want = quant_linear_ref(x, qw)
    assert cpu_compiled.exact_linear(x[:0], qw).shape == (0, 1000)  # a step whose sequences all left
    for rows in (1, 2, 8, 9, 40):  # the compiled one-row pass up to MAX_COMPILED_ROWS, dequantized blocks beyond
        got = cpu_compiled.exact_linear(x[:rows], qw)
        assert got.dtype == torch.float32 and got.shape == (rows, 1000)
        torch.testing.assert_close(got, want[:rows], rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert cpu_compiled.MAX_COMPILED_ROWS == 8


def test_exact_linear_is_float32_accurate_where_bf16_is_not():
    """The point of the kernel: logits as a float32 matmul gives them, not in bf16 steps (0.125 near 20)."""
    qw = grouped(512, 512, 32, False)
    w = dequantize(qw)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(2)) * 8
    want = x.double() @ w.double().T  # float64 reference
    err = lambda y: ((y.double() - want).abs().max() / want.abs().max()).item()  # noqa: E731
    assert err(cpu_compiled.exact_linear(x, qw)) < 1e-6 and err(x.bfloat16() @ w.bfloat16().T) > 1e-3


def test_only_int8_codes_with_float32_scales_are_taken():
    assert "int8 with float32 scales" in cpu_compiled.ready(quantize_int4(torch.randn(64, 64), 32))
    half = quantize_int8(torch.randn(64, 64), 32)
    half = QuantizedWeight("int8", half.qweight, half.scales.half(), None, 32, half.shape)
    assert cpu_compiled.ready(half) is not None


@pytest.mark.subprocess
def test_without_a_cxx_compiler_the_output_layer_falls_back_with_one_log_line(tmp_path):
    """A fresh inductor cache (nothing to load) and a compiler that does not exist: the output layer is the dense
    float32 Linear, and exactly one warning says why and what to do."""
    script = textwrap.dedent("""
        import logging, torch
        records = []
        class Keep(logging.Handler):
            def emit(self, r):
                records.append(r)
        logging.getLogger("ninfer").addHandler(Keep())
        logging.getLogger("ninfer").setLevel(logging.INFO)
        from engine.model.head import output_layer
        from kernels.quant import dequantize, quantize_int8
        w = quantize_int8(torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0)), 32)
        layer = output_layer(w, torch.float32, torch.device("cpu"))
        assert type(layer).__name__ == "Linear" and torch.equal(layer.weight, dequantize(w)), type(layer)
        lines = [r.getMessage() for r in records]
        assert len(lines) == 1 and records[0].levelname == "WARNING", lines
        print(lines[0])
    """)
    env = dict(os.environ, CXX="/nonexistent/c++", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "No working C++ compiler" in line and "--cpu-compile off" in line and "dense float32" in line, line
