"""The CPU's decode step in one C++ call (engine/model/cpu_fused.py, kernels/cpu_decode.cpp) on Llama, Qwen2 (qkv
bias, per-channel int8) and Qwen3 (q/k norms, head_dim 64) tiny models, float32 and float16 KV, scattered pages.

The oracle is the same model with its weights dequantized to float32 (the exact products) through the eager layers;
the eager layers over the same marked weights (the same GEMV and norm kernels, engine/model/llama.py) are the peer:
the C++ step must be as close to the exact products as they are. Both round the GEMVs' activations to int16 per
block of 32, so a last-bit difference upstream (RoPE, the attention's summation order) moves a value by one step
(1/32767 of its block's largest) now and then: on models this small that shows as ~1e-4 of the logits.
Also: a batch of sequences equals each sequence alone; what it refuses falls back with the reason."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.memory.kv.table import PageList
from engine.model import cpu_fused
from engine.model.linear import Linear, use_cpu_kernel
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.runner import ModelRunner, Work
from engine.tools.bench.cli import decode_path
from kernels.quant import dequantize
from tests.engine.helpers import rel_err, tiny_hf_model

PAGE = 16
NUM_PAGES = 24

pytestmark = pytest.mark.usefixtures("cpp_kernels")  # built on first use, not at collection

CASES = {  # arch, weight format, config overrides
    "llama-int4": ("llama", "int4", {}),
    "qwen2-int8": ("qwen2", "int8", {}),
    "qwen3-int4": ("qwen3", "int4", {"head_dim": 64, "hidden_size": 128, "intermediate_size": 256}),
}


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory):
    """(a model whose layers' weights are marked for the C++ kernel, the same checkpoint unmarked)."""
    arch, fmt, overrides = CASES[request.param]
    _, path = tiny_hf_model(arch, tmp_path_factory.mktemp(request.param), seed=5, num_hidden_layers=3, **overrides)
    marked, plain, exact = (build_model(load_weights(path)[1], torch.float32, torch.device("cpu"), fmt)
                            for _ in range(3))
    assert use_cpu_kernel(marked) is not None
    for layer in exact.layers:
        for v in vars(layer).values():
            if isinstance(v, Linear):
                v.weight = dequantize(v.weight, torch.float32)
    return marked, plain, exact


@pytest.fixture
def model(built):
    return built[0]


def runner(model, fused: bool, kv_dtype=torch.float32) -> ModelRunner:
    return ModelRunner(model, NUM_PAGES, kv_dtype, PAGE, max_batch=4, cpu_fused=fused)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, vocab, n)]


def forced(r: ModelRunner, ids: list[int], prompt: int, pages: list[int]) -> torch.Tensor:
    """Logits of every decode step after a prompt of `prompt` tokens, teacher-forced over `ids`: [steps, vocab]."""
    table = PageList(pages, PAGE)
    r.run([Work(ids[:prompt], 0, table)])
    return torch.cat([r.run([Work([ids[i]], i, table)])[0] for i in range(prompt, len(ids))])


def row_err(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per step: the largest logit difference over the largest logit."""
    return (ours - ref).abs().amax(-1) / ref.abs().amax(-1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_decode_steps_are_as_exact_as_the_eager_layers(built, kv_dtype):
    model, _, exact = built
    fused, eager = runner(model, True, kv_dtype), runner(model, False, kv_dtype)
    assert fused.graphs.fused is not None and eager.graphs.fused is None
    ids = tokens(1, 70, model.cfg.vocab_size)  # crosses pages of 16 and the C++ attention's chunks of 64
    pages = [9, 3, 4, 17, 0, 12]  # scattered: attention follows the page list
    want = forced(runner(exact, False, kv_dtype), ids, 5, pages)
    peer = forced(eager, ids, 5, pages)
    got = forced(fused, ids, 5, pages)
    assert fused.graphs.fused.steps == len(ids) - 5
    assert decode_path(fused) == f"{len(ids) - 5}, {len(ids) - 5} of them as one C++ call (kernels/cpu_decode.cpp)"
    ours, theirs = row_err(got, want), row_err(peer, want)
    assert ours.max() < 1e-3 and ours.mean() < 1.5 * theirs.mean(), (ours.max(), ours.mean(), theirs.mean())
    assert row_err(got, peer).max() < 1e-3
    top2 = want.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-2 * want.abs().amax(-1)  # steps without a near tie
    assert clear.sum() > 40 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_a_batch_equals_each_sequence_alone(model):
    r = runner(model, True)
    vocab = model.cfg.vocab_size
    seqs = [(tokens(2, 40, vocab), [5, 1, 20]), (tokens(3, 9, vocab), [7]), (tokens(4, 23, vocab), [2, 11])]
    alone = []
    for ids, pages in seqs:
        alone.append(forced(r, ids, len(ids) - 1, pages)[-1])
    tables = [PageList(p, PAGE) for _, p in seqs]
    for (ids, _), t in zip(seqs, tables):
        r.run([Work(ids[:-1], 0, t)])
    steps = r.graphs.fused.steps
    out = r.run([Work([ids[-1]], len(ids) - 1, t) for (ids, _), t in zip(seqs, tables)])
    assert r.graphs.fused.steps == steps + 1  # one call for the three
    for got, want in zip(out, alone):  # rows never mix: the same arithmetic row by row in C++ (the output layer's
        assert rel_err(got[0], want) < 1e-6  # BLAS may sum three rows in another order than one)


def test_what_it_does_not_take_decodes_layer_by_layer(built, caplog):
    model, plain, _ = built
    with caplog.at_level(logging.INFO, logger="ninfer.model"):
        assert runner(plain, True).graphs.fused is None
        assert runner(model, True, "k8v8").graphs.fused is None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "not every linear weight" in said and "the KV cache is k8v8" in said


def test_bad_operands_are_refused_with_a_reason(model):
    f = cpu_fused.FusedDecode(runner(model, False))
    model.rotary._extend(64)

    def call(weights=f.weights, ctx=1):
        return f.op(torch.zeros(1, model.cfg.hidden_size), weights, f.syms, f.norm, f.kv.k, f.kv.v,
                    model.rotary.cos, model.rotary.sin, torch.tensor([0]), torch.tensor([0]),
                    torch.zeros(1, 1, dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32), f.dims, f.eps,
                    f.scale)

    assert call().shape == (1, model.cfg.hidden_size)
    with pytest.raises(RuntimeError, match="18 weights"):
        call(weights=f.weights[:-1])
    with pytest.raises(RuntimeError, match="out of range"):
        call(ctx=PAGE + 1)  # more context than its one page holds


def test_a_hybrid_is_not_taken(tiny_qwen35):
    """A Qwen3.5 hybrid (a LlamaModel subclass with gated-attention and GDN layers) keeps its own layers."""
    _, path = tiny_qwen35(seed=3)
    hybrid = build_model(load_weights(path)[1], torch.float32, torch.device("cpu"), "int4")
    use_cpu_kernel(hybrid)
    assert "not a llama-family decoder" in cpu_fused.why_not(hybrid, None)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 64})])
def test_float32_weights_decode_in_one_call_and_match_transformers(tmp_path, arch, overrides):
    """A dense float32 model (its linears marked for dense_linear's GEMV, qkv biases and q/k norms included): every
    decode step's logits within 1e-5 of transformers' on the same weights, over scattered pages."""
    hf, path = tiny_hf_model(arch, tmp_path / arch, seed=6, num_hidden_layers=3, **overrides)
    model = build_model(load_weights(path)[1], torch.float32, torch.device("cpu"), "")
    assert use_cpu_kernel(model) is not None
    r = runner(model, True)
    assert r.graphs.fused is not None
    ids = tokens(8, 70, model.cfg.vocab_size)
    got = forced(r, ids, 5, [9, 3, 4, 17, 0, 12])
    assert r.graphs.fused.steps == len(ids) - 5
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, 5:].float()
    assert rel_err(got, want) <= 1e-5
