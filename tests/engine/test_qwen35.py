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
from engine.spec.ngram import NgramProposer
from engine.spec.speculator import Speculator
from tests.engine.helpers import add_tokenizer, collect, rel_err, run_concurrently, wait_idle

VOCAB = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(0.3 * torch.randn_like(p))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    folder = tmp_path_factory.mktemp("qwen35") / "tiny-qwen35"
    hf.save_pretrained(folder)
    add_tokenizer(folder, VOCAB)
    return hf, folder


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
