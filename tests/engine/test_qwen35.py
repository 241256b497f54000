"""Qwen3.5-class Gated-DeltaNet hybrids against transformers' Qwen3_5ForCausalLM (its torch path) on tiny random
checkpoints: 3 GDN layers : 1 gated attention layer, value heads > key heads, perturbed norms, A_log and dt_bias,
odd lengths that cross the 64-token chunks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.build import build_engine
from engine.memory.state import SeqState
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from tests.engine.helpers import collect, rel_err, run_concurrently, wait_idle
from tests.engine.qwen35_models import VOCAB


@pytest.fixture(scope="module")
def checkpoint(tiny_qwen35):
    return tiny_qwen35(seed=0)


@pytest.fixture(scope="module")
def model(checkpoint):
    return build_model(load_weights(checkpoint[1])[1], torch.float32, torch.device("cpu"))


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, n)]


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_the_config_lists_the_layers_and_the_pools_follow(model):
    cfg = model.cfg
    assert cfg.arch == "qwen35" and cfg.layer_kinds == ("recurrent",) * 3 + ("attention",) + ("recurrent",) * 3 + \
        ("attention",)
    assert cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 16 and cfg.partial_rotary == 0.25
    runner = ModelRunner(model, 4, torch.float32, 64, state_slots=2)
    assert runner.kv.num_layers == 2 and len(runner.state.layers) == 6
    assert runner.state.layers[0]["ssm"].shape == (2, 4, 16, 16) and runner.state.layers[0]["conv"].shape == (2, 128, 3)


@pytest.mark.parametrize("chunks", [[150], [37, 64, 29, 19], [1] * 20])
def test_logits_match_transformers(model, checkpoint, chunks):
    """One-shot prefill, chunked prefill at odd sizes, and token-by-token decode from the state pool."""
    hf, _ = checkpoint
    ids = tokens(1, sum(chunks))
    runner = ModelRunner(model, 4, torch.float32, 64, state_slots=1)
    pages, state, rows, start = runner.pool.allocate(3), SeqState(runner.state.allocate()), [], 0
    for n in chunks:
        rows.append(runner.run([Work(ids[start:start + n], start, pages, "all", state)])[0])
        start += n
    assert rel_err(torch.cat(rows), hf_logits(hf, ids)) <= 1e-4


def test_greedy_tokens_batched_and_alone_match_transformers(checkpoint):
    """build_engine on the folder; four prompts decoded together give what transformers generates for each."""
    hf, folder = checkpoint
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=4)
    try:
        engine = loaded.engine.start()
        prompts = [tokens(10 + i, 20 + 41 * i) for i in range(4)]
        results = run_concurrently(engine, prompts, [greedy(64)] * 4)
        for p, (out, _) in zip(prompts, results):
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=64, min_new_tokens=64)
            assert out == ref[0, len(p):].tolist()
        idle = wait_idle(engine)
        assert idle["pages_free"] == idle["pages_total"]
    finally:
        loaded.engine.shutdown()


@pytest.mark.parametrize("static", [False, True])
def test_batched_decode_steps_every_state_together_and_matches_transformers(model, checkpoint, static):
    """Three sequences of odd lengths decode 6 steps together, eagerly (recurrent layers batched over the state
    slots) and through the static decode forward that CUDA graphs record (batch 3 padded to 4: the dummy row steps
    the pool's scratch slot). Each row's logits equal transformers' on that sequence alone; a snapshot saved by a
    decode step at a page boundary (into host memory) holds the state after that token; the other slots are untouched."""
    hf, _ = checkpoint
    runner = ModelRunner(model, 8, torch.float32, 64, state_slots=5, static_decode=static)
    assert (runner.state.scratch is not None) == static
    prompts = [tokens(40 + i, n) for i, n in enumerate((61, 5, 90))]
    seqs = []
    for p in prompts:
        pages, state = runner.pool.allocate(2), SeqState(runner.state.allocate())
        runner.run([Work(p, 0, pages, "last", state)])
        seqs.append((p, pages, state))
    spare = runner.state.allocate()
    untouched = [t[spare].clone() for layer in runner.state.layers for t in layer.values()]
    snapshot = runner.state.host_buffer()
    steps = [[int(x) for x in np.random.default_rng(50 + s).integers(2, VOCAB, 3)] for s in range(6)]
    rows = []
    for step, new in enumerate(steps):
        works = []
        for (p, pages, state), t in zip(seqs, new):
            state.saves = [(0, snapshot)] if len(p) + step == 63 else []  # the first sequence reaches position 64
            works.append(Work([t], len(p) + step, pages, "last", state))
        rows.append(torch.cat(runner.run(works)))
    if static:
        assert runner.graphs.steps == 6
    for i, (p, _, _) in enumerate(seqs):
        ids = p + [s[i] for s in steps]
        ref = hf_logits(hf, ids)[len(p) - 1 + 1:]
        assert rel_err(torch.stack([r[i] for r in rows]), ref) <= 1e-4
    assert all(torch.equal(a, t[spare]) for a, t in zip(untouched, (t for layer in runner.state.layers
                                                                     for t in layer.values())))
    # the snapshot is the first sequence's state after its 64th token: continuing from it gives the same logits
    first = prompts[0] + [s[0] for s in steps]
    pages, state = runner.pool.allocate(2), SeqState(runner.state.allocate())
    runner.state.load(snapshot, state.slot)
    runner.kv.copy_pages(seqs[0][1][:1], pages[:1])
    out = runner.run([Work(first[64:], 64, pages, "all", state)])[0]
    assert rel_err(out, hf_logits(hf, first)[64:]) <= 1e-4


def test_prefix_reuse_restores_the_state_and_matches_a_cold_run(checkpoint):
    """A resent 3,000-token prompt reuses 2,944 tokens (98.1%: every full page but the last token's) from the state
    snapshot at that page boundary; its answer's logprobs equal a cold engine's."""
    _, folder = checkpoint
    prompt = tokens(20, 3000)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)

    def answer(loaded):
        engine = loaded.engine.start()
        toks, last, lps = [], None, []
        for out in engine.submit(prompt, params):
            toks += out.token_ids
            lps += [lp.logprob for lp in out.logprobs]
        return toks, lps

    warm = build_engine(folder, device="cpu", max_context=4096, max_concurrency=1, kv_capacity=8192)
    try:
        answer(warm)
        toks, lps = answer(warm)
        stats = warm.engine.stats()
        assert stats["prefix_hit_tokens"] == 2944 and stats["state_snapshot_hits"] == 1
        assert stats["prefix_hit_tokens"] / 3000 >= 0.98
    finally:
        warm.engine.shutdown()
    cold = build_engine(folder, device="cpu", max_context=4096, max_concurrency=1, max_shared_prefixes=0)
    try:
        cold_toks, cold_lps = answer(cold)
    finally:
        cold.engine.shutdown()
    assert toks == cold_toks
    assert max(abs(a - b) for a, b in zip(lps, cold_lps)) < 1e-4


@pytest.mark.slow
def test_ngram_speculation_on_a_hybrid_is_lossless(checkpoint, model):
    _, folder = checkpoint
    p = (tokens(30, 25) * 5)[:120]
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=1, spec="ngram")
    plain = build_engine(folder, device="cpu", max_context=512, max_concurrency=1)
    try:
        expected, _ = collect(plain.engine.start().submit(p, greedy(128)), timeout=300)
        got, _ = collect(loaded.engine.start().submit(p, greedy(128)), timeout=300)
        s = loaded.engine.stats()
        assert s["spec_drafted"] > 0 and got == expected
    finally:
        loaded.engine.shutdown()
        plain.engine.shutdown()


@pytest.mark.parametrize("fmt", ["int8", "int4", "ternary"])
def test_low_bit_weights_run_every_linear_of_the_hybrid(checkpoint, fmt):
    """Quantized at load, every linear of both layer kinds (GDN in/out projections, gated attention, MLP) is stored
    low-bit and computes what its dequantized twin computes in fp32, within the bf16 rounding of activations the
    CPU low-bit kernels use."""
    from dataclasses import replace

    from kernels.quant import QuantizedWeight, dequantize
    from engine.model.linear import convert

    weights = load_weights(checkpoint[1])[1]
    cpu = torch.device("cpu")
    twin = {n: dequantize(q, torch.float32) if isinstance(q := convert(n, t, fmt, torch.float32, cpu),
                                                          QuantizedWeight) else t for n, t in weights.tensors.items()}
    ids = tokens(40, 90)

    def logits(w, fmt_):
        model = build_model(w, torch.float32, cpu, fmt_)
        runner = ModelRunner(model, 4, torch.float32, 64, state_slots=1)
        return model, runner.run([Work(ids, 0, runner.pool.allocate(2), "all", SeqState(runner.state.allocate()))])[0]

    model, got = logits(weights, fmt)
    gdn, attention = model.layers[0], model.layers[3]
    assert all(isinstance(lin.weight, QuantizedWeight) for lin in (gdn.in_proj, gdn.out, gdn.gate_up, attention.qkv,
                                                                    attention.o))
    _, ref = logits(replace(weights, tensors=twin), "")
    assert ((got - ref).norm() / ref.norm()).item() < 0.02


def test_fp16_state_on_a_long_prompt_stays_finite_and_greedy_agrees(checkpoint):
    """--gdn-state-fp16: the state is stored in fp16 (half the state pool) and computed in fp32; over a 4,000-token
    prompt the logits stay finite, close to the fp32 state's, and 16 greedy tokens agree."""
    _, folder = checkpoint
    prompt = tokens(50, 4000)

    def run(fp16):
        loaded = build_engine(folder, device="cpu", max_context=4096, max_concurrency=1, max_shared_prefixes=0,
                              gdn_state_fp16=fp16)
        try:
            runner = loaded.engine.runner
            assert runner.state.layers[0]["ssm"].dtype == (torch.float16 if fp16 else torch.float32)
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
            outs = list(loaded.engine.start().submit(prompt, params))
            return runner.state.slot_bytes, [t for o in outs for t in o.token_ids], \
                [lp for o in outs for lp in o.logprobs]
        finally:
            loaded.engine.shutdown()

    bytes32, tokens32, lps32 = run(False)
    bytes16, tokens16, lps16 = run(True)
    assert tokens16 == tokens32
    assert all(np.isfinite(lp.logprob) for lp in lps16)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lps16, lps32)) < 0.05
    assert bytes32 - bytes16 == 6 * 4 * 16 * 16 * 2  # 6 GDN layers' 4 x 16 x 16 states halve; the conv windows stay


def test_fp16_state_is_refused_for_a_model_without_recurrent_layers(engine_for, tmp_path):
    from engine.errors import NInferError

    with pytest.raises(NInferError, match="has no such layers"):
        engine_for(None, device="cpu", max_context=256, max_concurrency=1, gdn_state_fp16=True)
