"""The fused-MoE Triton kernel (kernels/moe.py, interpreter) against its twin (reference.fused_moe_ref) and against
the engine's per-expert loop (engine/model/moe.py MoEMLP with Triton off), dense float32/float16 and low-bit experts,
then a tiny MoE model's logits with and without Triton.

Routing in these tests: expert E-1 is picked by every token, experts 0 and 1 by none; H and I are not multiples of
the blocks (masks), T = 17 spans several row blocks of one expert."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from engine.model.moe import MoEMLP  # noqa: E402
from kernels.moe import align_blocks, fused_moe  # noqa: E402
from kernels.quant import QuantizedWeight, dequantize, quantize  # noqa: E402
from kernels.reference import fused_moe_ref  # noqa: E402
from tests.kernels.tolerances import assert_close  # noqa: E402


def routing(t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [t, k] summing to 1, ids [t, k]): E-1 first in every row, the rest distinct from 2..E-2."""
    pool = torch.arange(2, e - 1)
    ids = torch.stack([torch.cat((torch.tensor([e - 1]), pool[torch.randperm(len(pool))[:k - 1]])) for _ in range(t)])
    return torch.softmax(torch.randn(t, k), -1), ids


def moe_layer(e: int, k: int, h: int, inter: int, dtype: torch.dtype, lowbit=lambda name: None,
              device=None) -> MoEMLP:
    """A MoEMLP of e random experts (no shared expert) built as the engine builds one, from per-expert tensors;
    `lowbit(name)`: None (dense in dtype) or the (format, group) that tensor is quantized to."""
    cfg = SimpleNamespace(moe=SimpleNamespace(top_k=k, norm_topk=True, num_experts=e, shared_size=0))
    w = {"mlp.gate.weight": torch.randn(e, h)}
    for i in range(e):
        p = f"mlp.experts.{i}."
        w |= {p + "gate_proj.weight": torch.randn(inter, h) / h ** 0.5, p + "up_proj.weight": torch.randn(inter, h),
              p + "down_proj.weight": torch.randn(h, inter) / inter ** 0.5}
    w = {n: t.to(device=device, dtype=dtype) if lowbit(n) is None else quantize(t.to(device or t.device), *lowbit(n))
         for n, t in w.items()}
    return MoEMLP(cfg, w, "")


def loop(moe: MoEMLP, x, weights, ids, monkeypatch) -> torch.Tensor:
    """The current per-expert path (one token: its k experts; more: grouped by expert with index_add)."""
    with monkeypatch.context() as m:
        m.setenv("NINFER_NO_TRITON", "1")
        return moe._routed(x, weights, ids)


def test_align_blocks_groups_every_pair_once():
    ids = torch.tensor([[4, 0], [4, 2], [4, 0]])  # expert 4 thrice, 0 twice, 2 once; 1 and 3 never
    sorted_ids, expert = align_blocks(ids, 5, 4)
    assert len(expert) == 6 // 4 + 5 and sorted_ids.numel() == len(expert) * 4
    assert expert.tolist() == [0, 2, 4, -1, -1, -1]
    blocks = sorted_ids.view(-1, 4)[:3].tolist()
    assert blocks == [[1, 5, 6, 6], [3, 6, 6, 6], [0, 2, 4, 6]]  # pair t * k + j, 6 = padding, rows in token order


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("e,k", [(8, 2), (8, 3), (5, 2), (5, 3)])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_dense_experts_match_the_twin_and_the_loop(t, e, k, dtype, monkeypatch):
    h, inter = 80, 48
    moe = moe_layer(e, k, h, inter, dtype)
    x = torch.randn(t, h).to(dtype)
    weights, ids = routing(t, e, k)
    before = loop(moe, x, weights, ids, monkeypatch)
    out = moe._routed(x, weights, ids)  # builds the stacks: the fused kernel from here on
    gate_up, down = moe.stacks
    assert gate_up.shape == (e, 2 * inter, h) and down.shape == (e, h, inter)
    assert all(x.gate_up.weight.data_ptr() == gate_up[i].data_ptr() for i, x in enumerate(moe.experts))
    assert_close(out, fused_moe_ref(x, gate_up, down, weights, ids), what="kernel vs twin")
    # float16: the loop rounds each expert's output, its weighting and each partial sum to fp16 (the kernel and the
    # twin once, after a float32 sum): a few ulp of the result's scale apart
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-3, 4e-3)
    bound = rtol * before.float().abs() + atol * before.float().abs().max()
    assert ((out.float() - before.float()).abs() <= bound).all(), (out.float() - before.float()).abs().max()
    assert torch.equal(loop(moe, x, weights, ids, monkeypatch), before)  # the loop over the views: the same weights


def stacked(parts: list[QuantizedWeight]) -> QuantizedWeight:
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    p = parts[0]
    return QuantizedWeight(p.format, cat([q.qweight for q in parts]), cat([q.scales for q in parts]),
                           cat([q.mins for q in parts]), p.group_size, (len(parts) * p.out_features, p.in_features))


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4_asym", 32), ("int4_sym", 32), ("int8", 32)],
                         ids=["int8-channel", "int4_asym-g32", "int4_sym-g32", "int8-g32"])
def test_low_bit_experts_match_the_dequantized_twin(fmt, group):
    e, k, h, inter, t = 5, 2, 96, 64, 17
    gu = [quantize(torch.randn(2 * inter, h) / h ** 0.5, fmt, group) for _ in range(e)]
    dn = [quantize(torch.randn(h, inter) / inter ** 0.5, fmt, group) for _ in range(e)]
    qgu, qdn = stacked(gu), stacked(dn)
    weights, ids = routing(t, e, k)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(t, h).to(dtype)
        want = fused_moe_ref(x, qgu, qdn, weights, ids)
        dense = fused_moe_ref(x, torch.stack([dequantize(q) for q in gu]), torch.stack([dequantize(q) for q in dn]),
                              weights, ids)
        assert torch.equal(want, dense)  # the twin reads each expert's rows as dequantize does
        assert_close(fused_moe(x, qgu, qdn, weights, ids), want, what=f"{fmt} {dtype}")


def test_low_bit_layer_stacks_into_one_quantized_weight():
    """MoEMLP over int4 experts: one QuantizedWeight per projection, each expert's Linear a view of its rows; the
    fused kernel against the twin and against the loop (Triton's GEMM per expert, the same float32 products)."""
    e, k, h, inter = 5, 2, 64, 32
    moe = moe_layer(e, k, h, inter, torch.float32, lambda name: None if "gate.weight" in name else ("int4_asym", 32))
    x = torch.randn(3, h)
    weights, ids = routing(3, e, k)
    before = moe._grouped(x, weights, ids)  # Triton on: each expert's Linear through kernels/qlinear
    out = moe._routed(x, weights, ids)
    gate_up, down = moe.stacks
    assert isinstance(gate_up, QuantizedWeight) and gate_up.shape == (e * 2 * inter, h) and down.shape == (e * h, inter)
    assert moe.experts[3].down.weight.qweight.data_ptr() == down.qweight[3 * h].data_ptr()
    assert_close(out, fused_moe_ref(x, gate_up, down, weights, ids), what="kernel vs twin")
    assert_close(out, before, what="kernel vs loop")


def test_host_experts_are_never_stacked():
    """--n-cpu-moe's experts (host memory, the CPU path) keep their own tensors and the loop."""
    moe = moe_layer(5, 2, 64, 32, torch.float32, device="cpu")
    moe.host = True
    weights, ids = routing(3, 5, 2)
    moe._routed(torch.randn(3, 64, device="cpu"), weights.cpu(), ids.cpu())
    assert moe.stacks is None and all(x.down.weight._base is None for x in moe.experts)


def test_experts_of_different_formats_keep_the_loop():
    moe = moe_layer(5, 2, 64, 32, torch.float32, lambda name: ("int8", None) if name.endswith("3.down_proj.weight")
                    else None)
    x = torch.randn(3, 64)
    weights, ids = routing(3, 5, 2)
    ids[0, 1] = 3
    assert_close(moe._routed(x, weights, ids), moe._grouped(x, weights, ids), what="mixed")
    assert moe.stacks == () and all(x.down.weight._base is None for x in moe.experts[:3])


def moe_model_logits(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Every position's logits, the prompt run in chunks of the given sizes (1: a decode step)."""
    from engine.memory.state import SeqState
    from engine.runner import ModelRunner, Work

    runner = ModelRunner(model, 4, torch.float32, 64, state_slots=1)
    pages, state, rows, start = runner.pool.allocate(1), SeqState(runner.state.allocate()), [], 0
    for n in chunks:
        rows.append(runner.run([Work(ids[start:start + n], start, pages, "all", state)])[0])
        start += n
    return torch.cat(rows)


def test_tiny_moe_model_logits_match_the_torch_path(monkeypatch, tmp_path):
    """The tiny seeded Qwen3.5-MoE hybrid (tests/engine/qwen35_moe_models.py: 4 MoE layers of 7 experts, top 3, a
    shared expert; float32) with Triton on (interpreted here; the routed experts through kernels/moe.py) and off
    (the PyTorch twins, the per-expert loop): a prefill chunk of 21 tokens, a second of 7, then two decode steps.
    The chunked delta rule runs its twin in both (its kernel is test_gated_delta.py's; interpreted, it took most of
    this test's time)."""
    for needed in ("transformers", "safetensors"):
        pytest.importorskip(needed)
    from engine.model.loader import load_weights
    from engine.model.registry import build_model
    from kernels import dispatch, reference
    from kernels import moe as moe_kernel
    from tests.engine.qwen35_moe_models import tiny_moe_checkpoint
    from tests.kernels.conftest import DEVICE

    with torch.device("cpu"):
        _, folder = tiny_moe_checkpoint(tmp_path / "moe", seed=2)
    weights = load_weights(folder)[1]
    ids = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(5), device="cpu").tolist()
    chunks = [21, 7, 1, 1]
    monkeypatch.setenv("NINFER_NO_TRITON", "1")
    ref = moe_model_logits(build_model(weights, torch.float32, torch.device(DEVICE)), ids, chunks)
    monkeypatch.delenv("NINFER_NO_TRITON")
    monkeypatch.setattr(dispatch, "gdn_chunked", reference.gdn_chunked_ref)
    calls = []
    real = moe_kernel.fused_moe
    monkeypatch.setattr(moe_kernel, "fused_moe", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    model = build_model(weights, torch.float32, torch.device(DEVICE))
    ours = moe_model_logits(model, ids, chunks)
    assert calls == [n for n in chunks for _ in model.layers]  # every step, every layer
    assert all(layer.moe.stacks for layer in model.layers)
    # float32 on both sides, so only summation orders differ (the kernels' tiles against ATen's; the k experts'
    # sum in float32 against the loop's running sum); no router decision is near a tie at that size. Measured
    # 2e-7 (interpreter); a wrong row, weight or expert is 1e-2 or more.
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
