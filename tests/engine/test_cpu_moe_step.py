"""A Qwen3.5-MoE hybrid's CPU decode step in one C++ call (kernels/cpu_moe.cpp inside kernels/cpu_hybrid.cpp) on the
tiny seeded MoE checkpoints of tests/engine/qwen35_moe_models.py (7 experts, top 3, a shared expert; routers far from
uniform) and a Qwen3-Next one whose layers 1 and 5 keep a dense MLP.

The oracle is transformers on the same float32 weights; the peer, the engine's eager layers (engine/model/moe.py)
over the same weights, dense float32 or the same low-bit kernels. Also: rows of a batch that pick the same expert go
through it together and equal each row alone."""
from __future__ import annotations

import pytest
import torch

from engine.memory.kv.table import PageList
from engine.memory.state import SeqState
from engine.model import cpu_hybrid
from engine.runner import Work
from kernels import cpu_native
from tests.engine.helpers import rel_err
from tests.engine.qwen35_moe_models import tiny_moe_checkpoint, tiny_qwen3_next_moe
from tests.engine.test_cpu_hybrid import PAGE, build, forced, runner, tokens
pytestmark = pytest.mark.usefixtures("cpp_kernels")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return tiny_moe_checkpoint(tmp_path_factory.mktemp("cpu-moe") / "moe", seed=1)


@pytest.fixture(scope="module")
def next_moe(tmp_path_factory):
    return tiny_qwen3_next_moe(tmp_path_factory.mktemp("cpu-next-moe") / "next-moe", norm_topk=True)


@pytest.mark.parametrize("which", ["qwen35-moe", "qwen3-next-partly-dense"])
def test_decode_steps_match_transformers(moe, next_moe, which):
    """Float32 weights: every decode step's logits within 1e-4 of transformers' and 1e-5 of the eager layers'."""
    hf, folder = moe if which == "qwen35-moe" else next_moe
    model = build(folder)
    r = runner(model, True)
    assert isinstance(r.graphs.fused, cpu_hybrid.HybridDecode)
    if which != "qwen35-moe":
        assert r.graphs.fused.moe_at[1] == r.graphs.fused.moe_at[5] == -1 and r.graphs.fused.moe_at[2] > 0
    ids = tokens(1, 60)
    got = forced(r, ids, 6, [0, 1, 2, 3])
    assert r.graphs.fused.steps == len(ids) - 6
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, 6:].float()
    assert rel_err(got, want) <= 1e-4
    assert rel_err(got, forced(runner(model, False), ids, 6, [0, 1, 2, 3])) <= 1e-5


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_low_bit_experts_are_as_exact_as_the_eager_layers(moe, fmt):
    """Low-bit experts go through the GEMV kernel the eager layers call: within 1e-3, the same tokens where the top
    two are apart."""
    _, folder = moe
    model = build(folder, fmt)
    fused, eager = runner(model, True), runner(model, False)
    assert fused.graphs.fused is not None and eager.graphs.fused is None
    ids = tokens(2, 60)
    got, peer = forced(fused, ids, 5, [3, 0, 8, 1]), forced(eager, ids, 5, [3, 0, 8, 1])
    assert (got - peer).abs().max() / peer.abs().max() < 1e-3
    top2 = peer.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-2 * peer.abs().amax(-1)
    assert clear.sum() > 30 and torch.equal(got.argmax(-1)[clear], peer.argmax(-1)[clear])


def test_a_batch_equals_each_sequence_alone(moe):
    """Three rows in one step (7 experts, 3 each: some expert serves two or three rows at once) equal each alone."""
    _, folder = moe
    r = runner(build(folder), True, slots=5)
    seqs = [(tokens(4, 40), [5, 1, 20]), (tokens(5, 9), [7]), (tokens(6, 23), [2, 11])]
    alone = [forced(r, ids, len(ids) - 1, pages)[-1] for ids, pages in seqs]
    r.state.free([0, 1, 2])
    works = []
    for ids, pages in seqs:
        table, state = PageList(pages, PAGE), SeqState(r.state.allocate())
        r.run([Work(ids[:-1], 0, table, "last", state)])
        works.append(Work([ids[-1]], len(ids) - 1, table, "last", state))
    steps = r.graphs.fused.steps
    out = r.run(works)
    assert r.graphs.fused.steps == steps + 1
    for got, want in zip(out, alone):
        assert rel_err(got[0], want) < 1e-6


def test_bad_moe_operands_are_refused_with_a_reason(moe):
    _, folder = moe
    model = build(folder)
    f = cpu_hybrid.HybridDecode(runner(model, False))
    model.rotary._extend(16)

    def call(moe_layers=f.moe_layers):
        layers = f.state.layers
        return f.op(torch.zeros(1, model.cfg.hidden_size), f.weights, f.kinds, f.syms, f.norm, f.kv.k, f.kv.v,
                    [t["conv"] for t in layers], [t["ssm"] for t in layers], torch.tensor([0]),
                    model.rotary.cos, model.rotary.sin, torch.tensor([0]), torch.tensor([0]),
                    torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32), f.dims, f.eps,
                    moe_layers)

    def layers(moe_weights=f.moe_weights, moe_at=f.moe_at, moe_dims=f.moe_dims):
        return cpu_native.moe_layers(moe_weights, moe_at, f.moe_syms, moe_dims, model.cfg.hidden_size)

    assert call().shape == (1, model.cfg.hidden_size)
    with pytest.raises(RuntimeError, match="must name each decoder layer"):
        call(layers(moe_at=f.moe_at[:-1]))
    with pytest.raises(RuntimeError, match="top_k must lie"):
        layers(moe_dims=[7, 8, 1])
    with pytest.raises(RuntimeError, match="lacks entries"):
        layers(moe_weights=f.moe_weights[:-6])
    with pytest.raises(RuntimeError, match="router"):
        layers(moe_weights=[f.moe_weights[0][:, :-1].contiguous()] + f.moe_weights[1:])
