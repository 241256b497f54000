"""kernels/cpu_moe_prompt.cpp (engine/model/moe_prompt.py) against its twin, MoEMLP._grouped's Python loop over the
same experts, and against float64 products of the dequantized weights; and the MoE block taking it for prompts."""
import pytest
import torch
import torch.nn.functional as F

from engine.model import moe
from engine.model.linear import DenseScratch
from engine.model.moe_prompt import prompt_operands, routed_prompt
from kernels import cpu, dispatch
from kernels.quant import dequantize, quantize

H, I, E, K = 128, 64, 6, 3


@pytest.fixture
def native(cpp_kernels, monkeypatch):
    monkeypatch.setattr(dispatch, "use_triton", lambda device: False)  # as without TRITON_INTERPRET (the suite sets it)


def experts(fmt: str, seed: int) -> list[moe.Expert]:
    """E experts of `fmt` (groups of 32) marked for the C++ kernel, one DenseScratch from NATIVE_ROWS + 1 rows (as
    engine/model/linear.use_cpu_kernel and enable_dense_prefill leave them)."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for e in range(E):
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w[f"x.{e}.{name}.weight"] = quantize(torch.randn(*shape, generator=g) * 0.2, fmt, 32)
    out = [moe.Expert(w, f"x.{e}.") for e in range(E)]
    scratch = DenseScratch(cpu.NATIVE_ROWS + 1)
    for lin in (lin for x in out for lin in x.linears()):
        lin.weight.cache["lowbit_native"] = True
        lin.scratch = scratch
    return out


def routing(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) picking expert 0 often (> NATIVE_ROWS rows), expert E - 1 never, and others a few times."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, E, generator=g) + torch.tensor([4.0, 0, 0, 0, -1.5, -1e9])
    return moe.route(logits, K, True)


def grouped(xs: list[moe.Expert], h, weights, ids) -> torch.Tensor:
    block = object.__new__(moe.MoEMLP)
    block.experts, block.top_k = xs, K
    return block._grouped(h, weights, ids)


@pytest.mark.parametrize("fmt", ["int4_sym", "int4_asym", "int8"])
def test_the_cpp_call_equals_the_python_loop_over_the_experts(native, fmt):
    """Experts with more rows than the low-bit kernel takes (dense bf16 or float32), with fewer, and unpicked."""
    xs = experts(fmt, seed=1)
    h = torch.randn(90, H, generator=torch.Generator().manual_seed(2))
    weights, ids = routing(90, seed=3)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert counts[0] > cpu.NATIVE_ROWS and 0 < counts[4] <= cpu.NATIVE_ROWS and counts[E - 1] == 0
    operands = prompt_operands(xs)
    assert operands is not None and operands[2] == cpu.NATIVE_ROWS
    with torch.inference_mode():  # as the engine runs it: the kernel's threads must take the mode
        got = routed_prompt(h, weights, ids, operands)
    want = grouped(xs, h, weights, ids)
    assert got.dtype == torch.float32 and got.shape == h.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * want.abs().max().item())
    # and both near the float64 products of the weights the file gives (bf16 rounding of the dense rows)
    exact = torch.zeros(90, H, dtype=torch.float64)
    for t in range(90):
        for j in range(K):
            x = xs[ids[t, j]]
            gu = h[t].double() @ dequantize(x.gate_up.weight, torch.float64).T
            act = F.silu(gu[:I]) * gu[I:]
            exact[t] += weights[t, j].double() * (act @ dequantize(x.down.weight, torch.float64).T)
    assert (got.double() - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_the_block_takes_the_cpp_call_for_prompts_only_where_it_computes_the_same(native, monkeypatch):
    xs = experts("int4_sym", seed=4)
    calls = []
    real = moe.routed_prompt
    monkeypatch.setattr(moe, "routed_prompt", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    block = object.__new__(moe.MoEMLP)
    block.experts, block.top_k, block.host = xs, K, False
    h = torch.randn(40, H, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(40, seed=6)
    block._routed(h, weights, ids)
    block._routed(h[:1], weights[:1], ids[:1])  # one token: its k experts, no grouping
    assert calls == [40]
    xs[2].down.scratch = None  # a Linear the dense prompt path does not reach: the loop computes what it does
    assert prompt_operands(xs) is None
    torch.testing.assert_close(block._routed(h, weights, ids), grouped(xs, h, weights, ids), rtol=0, atol=0)
    assert calls == [40]
