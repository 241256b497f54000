"""Prefix reuse, speculation (ngram, a draft model, the checkpoint's MTP block) and state rollback on a tiny random
Qwen3.5-MoE hybrid (tests/engine/qwen35_moe_models.py), as for the dense hybrid: each gives the output of a plain
cold run, token for token, and hands back every page and state slot."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.build import build_engine
from engine.sampling import SamplingParams
from tests.engine.helpers import collect, run_concurrently, wait_idle
from tests.engine.qwen35_models import VOCAB
from tests.engine.qwen35_moe_models import tiny_moe_checkpoint
from tests.engine.spec_models import add_tensors


def random_mtp(folder) -> None:
    """Adds an MTP block to the checkpoint: a gated attention layer with a MoE MLP (as Qwen3.5-MoE's mtp.layers.0
    holds one: router, 7 experts, shared expert and gate), shaped as the model's attention layer 3, random."""
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    layer = {n.removeprefix("model.layers.3."): t for n, t in tensors.items() if n.startswith("model.layers.3.")}
    assert "mlp.experts.6.down_proj.weight" in layer and "mlp.shared_expert_gate.weight" in layer
    mtp = {f"mtp.layers.0.{n}": (0.3 if n.endswith("norm.weight") else 0.1) * torch.randn(t.shape, generator=g)
           for n, t in layer.items()}
    mtp |= {"mtp.fc.weight": 0.1 * torch.randn(64, 128, generator=g),
            **{f"mtp.{n}.weight": 0.3 * torch.randn(64, generator=g)
               for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    add_tensors(folder, mtp)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    _, path = tiny_moe_checkpoint(tmp_path_factory.mktemp("moe-spec") / "moe", seed=3)
    random_mtp(path)
    return path


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def generate(folder, prompts, n: int, **kw) -> tuple[list[list[int]], dict]:
    """Greedy output of the prompts at once, every speculative step drafting (no adaptive pauses); the stats once
    idle, after checking that every page and state slot came back."""
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=2, max_shared_prefixes=0, **kw)
    engine = loaded.engine
    if engine.speculator is not None:
        engine.speculator.adaptive = False
    try:
        engine.start()
        outs = [out for out, _ in run_concurrently(engine, prompts, [greedy(n)] * len(prompts))]
        stats = wait_idle(engine)
        assert stats["pages_free"] == stats["pages_total"]
        assert engine.runner.state.num_free == engine.runner.state.num_slots
        if engine.speculator is not None and hasattr(engine.speculator.proposer, "states"):
            states = engine.speculator.proposer.states
            assert states.num_free == states.num_slots
        return outs, stats
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain(folder):
    prompts = [(tokens(30, 25) * 5)[:120], tokens(31, 57)]  # a repetitive one (ngram drafts from it), a random one
    return prompts, generate(folder, prompts, 96)[0]


def test_prefix_reuse_restores_the_state_and_matches_a_cold_run(folder):
    """A resent 700-token prompt reuses every full page but the last token's (640 of 700, from the state snapshot at
    that boundary); its answer's tokens and logprobs equal a cold engine's."""
    prompt = tokens(20, 700)
    params = greedy(16, logprobs=3)

    def answer(engine):
        toks, lps = [], []
        for out in engine.submit(prompt, params):
            toks += out.token_ids
            lps += [lp.logprob for lp in out.logprobs]
        return toks, lps

    warm = build_engine(folder, device="cpu", max_context=1024, max_concurrency=1, kv_capacity=4096)
    try:
        engine = warm.engine.start()
        answer(engine)
        toks, lps = answer(engine)
        stats = wait_idle(engine)
        assert stats["prefix_hit_tokens"] == 640 and stats["state_snapshot_hits"] == 1
    finally:
        warm.engine.shutdown()
    cold = build_engine(folder, device="cpu", max_context=1024, max_concurrency=1, max_shared_prefixes=0)
    try:
        cold_toks, cold_lps = answer(cold.engine.start())
    finally:
        cold.engine.shutdown()
    assert toks == cold_toks
    assert max(abs(a - b) for a, b in zip(lps, cold_lps)) < 1e-4


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_is_lossless_and_rolls_the_state_back(folder, plain, method, one_thread):
    """Two requests at once, drafting 3 tokens every step: rejected drafts roll the GDN state back, and the output is
    the plain run's, token for token."""
    prompts, expected = plain
    got, s = generate(folder, prompts, 96, spec=method, draft_tokens=3)
    assert got == expected
    assert s["spec_method"] == method and s["spec_drafted"] > 0 and s["state_rollbacks"] > 0


def test_the_model_drafting_for_itself_is_lossless_and_accepted(folder, plain, one_thread):
    """The MoE model as its own draft model: its drafts are the target's greedy tokens, so nearly all are accepted,
    and its own state slots all come back."""
    prompts, expected = plain
    got, s = generate(folder, prompts, 96, spec="draft", draft_model=str(folder), draft_tokens=3)
    assert got == expected
    assert s["spec_drafted"] > 0 and s["spec_accepted"] / s["spec_drafted"] > 0.9


def test_the_mtp_block_runs_a_moe_mlp(folder):
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=1, spec="mtp")
    try:
        layer = loaded.engine.speculator.proposer.module.layer
        assert layer.moe is not None and len(layer.moe.experts) == 7 and layer.moe.shared is not None
        out, _ = collect(loaded.engine.start().submit(tokens(5, 40), greedy(8)), timeout=120)
        assert len(out) == 8
    finally:
        loaded.engine.shutdown()
