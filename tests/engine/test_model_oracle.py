"""Our forward pass against transformers (fp32) on tiny random Llama / Qwen2 / Qwen3 models built here:
logits for prefill and every decode step, greedy continuations, chunked prefill, batching."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.memory.kv.table import PageList
from engine.runner import Work
from engine.sampling import SamplingParams
from tests.engine.helpers import (PAGE, hf_greedy, hf_logits, make_engine, make_runner, random_prompt,
                                  rel_err, run_concurrently, runner_logits)

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = ["llama", "qwen2", "qwen3", "llama-tied", "llama-rope3"]
TOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def prompt_for(variant: str, n: int, salt: int = 0) -> list[int]:
    rng = np.random.default_rng(VARIANTS.index(variant) * 100_000 + n * 100 + salt)
    return random_prompt(rng, 512, n)


def test_tiny_models_have_the_features_under_test(tiny_models):
    """The variants really differ in what they are meant to exercise (guards against a silent config change)."""
    from engine.model.loader import load_weights

    cfgs = {v: load_weights(tiny_models(v)[1])[1].config for v in VARIANTS}
    assert cfgs["qwen2"].attention_bias and cfgs["qwen2"].arch == "qwen2"
    qwen3 = cfgs["qwen3"]
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.hidden_size // qwen3.num_heads == 16
    assert cfgs["llama-tied"].tie_embeddings and not cfgs["llama"].tie_embeddings
    assert cfgs["llama-rope3"].rope_scaling["rope_type"] == "llama3"
    assert all(c.num_kv_heads < c.num_heads for c in cfgs.values())  # GQA everywhere


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_each_decode_step_match_transformers(tiny_models, variant):
    hf, folder = tiny_models(variant)
    runner = make_runner(folder, num_pages=8)
    prompt = prompt_for(variant, 60)
    pages = PageList([5, 0, 3])  # out of order on purpose; decode crosses from the first page into the second
    ours = runner.run([Work(prompt, 0, pages, "all")])[0]
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    ref = out.logits[0].float()
    assert ours.shape == ref.shape == (60, hf.config.vocab_size)
    assert rel_err(ours, ref) <= TOL, f"prefill logits differ by {rel_err(ours, ref):.2e}"
    past = out.past_key_values
    tokens = list(prompt)
    for step in range(40):
        tok = int(ours[-1].argmax())
        tokens.append(tok)
        ours = runner.run([Work([tok], len(tokens) - 1, pages, "last")])[0]
        with torch.no_grad():
            out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        ref = out.logits[0, -1:].float()
        err = rel_err(ours, ref)
        assert err <= TOL, f"decode step {step} (position {len(tokens) - 1}) logits differ by {err:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_64_tokens_equal_transformers_generate(tiny_models, variant):
    hf, folder = tiny_models(variant)
    prompt = prompt_for(variant, 21, salt=1)
    engine = make_engine(folder, num_pages=8)
    try:
        ours = engine.generate(prompt, GREEDY)
    finally:
        engine.shutdown()
    ref = hf_greedy(hf, prompt, 64)
    assert len(ours) == 64
    assert ours == ref


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_chunked_prefill_in_the_engine_equals_one_shot(tiny_models, variant):
    """Prompts of ~150 tokens (three pages) prefilled 7 or 64 tokens a step, alone and sharing the budget with
    another prompt, give the same greedy continuation as a one-shot prefill."""
    _, folder = tiny_models(variant)
    runner = make_runner(folder, num_pages=16)
    prompts = [prompt_for(variant, 150, salt=2), prompt_for(variant, 131, salt=3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {}
    for chunk in (4096, 7, 64):
        engine = make_engine(runner, prefill_chunk=chunk)
        try:
            alone = [engine.generate(p, params) for p in prompts]
            together = [tokens for tokens, _ in run_concurrently(engine, prompts, [params] * 2)]
            assert runner.pool.num_free == runner.pool.num_pages
        finally:
            engine.shutdown()
        results[chunk] = (alone, together)
        if chunk == 7:
            assert engine.counters["steps"] >= 2 * 2 * (150 // 7)  # the prompts really were cut up
    one_shot = results[4096][0]
    assert all(len(t) == 16 for t in one_shot)
    for chunk, (alone, together) in results.items():
        assert alone == one_shot, f"prefill_chunk={chunk}"
        assert together == one_shot, f"prefill_chunk={chunk}, two requests at once"


@pytest.mark.parametrize("variant", ["llama", "qwen3", "llama-rope3"])
@pytest.mark.parametrize("chunks", [[7], [64], [1, 63, 2, 5, 70]], ids=["7", "64", "ragged"])
def test_chunked_prefill_in_the_runner_equals_one_shot(tiny_models, variant, chunks):
    hf, folder = tiny_models(variant)
    runner = make_runner(folder, num_pages=8)
    prompt = prompt_for(variant, 150, salt=4)
    one_shot = runner_logits(runner, prompt, pages=PageList([6, 1, 4]))
    chunked = runner_logits(runner, prompt, chunks=chunks, pages=PageList([2, 7, 0]))
    assert rel_err(chunked, one_shot) <= 1e-5
    assert torch.equal(chunked.argmax(-1), one_shot.argmax(-1))
    assert rel_err(one_shot, hf_logits(hf, prompt)) <= TOL
    # the KV cache the chunks left behind decodes like the one-shot one
    tok = int(one_shot[-1].argmax())
    a = runner.run([Work([tok], 150, PageList([6, 1, 4]), "last")])[0]
    b = runner.run([Work([tok], 150, PageList([2, 7, 0]), "last")])[0]
    assert rel_err(b, a) <= 1e-5
    # as the engine runs them: no logits until the last chunk, which asks for its last row only
    start, pages = 0, PageList([3, 5, 2])
    while start < len(prompt):
        n = min(chunks[0] if len(chunks) == 1 else chunks[(start // 7) % len(chunks)], len(prompt) - start)
        last = start + n == len(prompt)
        out = runner.run([Work(prompt[start:start + n], start, pages, "last" if last else None)])[0]
        assert (out is None) != last
        start += n
    assert out.shape[0] == 1 and rel_err(out, one_shot[-1:]) <= 1e-5


def test_mixed_batch_equals_separate_runs(tiny_models):
    """One step holding a prefill chunk, a whole prompt and a decode gives each sequence its own logits."""
    hf, folder = tiny_models("qwen2")
    runner = make_runner(folder, num_pages=12)
    a, b, c = prompt_for("qwen2", 100, 5), prompt_for("qwen2", 30, 6), prompt_for("qwen2", 70, 7)
    pa, pb, pc = PageList([0, 1]), PageList([2]), PageList([3, 4])
    # c: prefill its first 69 tokens alone, so that its last token is a decode step in the batch
    runner.run([Work(c[:69], 0, pc, None)])
    # a: first 40 tokens alone, the rest (a chunk starting mid-page) in the batch
    runner.run([Work(a[:40], 0, pa, None)])
    la, lb, lc = runner.run([Work(a[40:], 40, pa, "all"), Work(b, 0, pb, "last"), Work(c[69:], 69, pc, "last")])
    assert la.shape[0] == 60 and lb.shape[0] == 1 and lc.shape[0] == 1
    assert rel_err(la, hf_logits(hf, a)[40:]) <= TOL
    assert rel_err(lb, hf_logits(hf, b)[-1:]) <= TOL
    assert rel_err(lc, hf_logits(hf, c)[-1:]) <= TOL


def test_page_size_boundaries_exactly(tiny_models):
    """Prompts of 63, 64, 65 and 128 tokens: the last token of a page and the first of the next."""
    hf, folder = tiny_models("llama")
    runner = make_runner(folder, num_pages=8)
    for n in (63, PAGE, PAGE + 1, 2 * PAGE):
        prompt = prompt_for("llama", n, salt=8)
        assert rel_err(runner_logits(runner, prompt), hf_logits(hf, prompt)) <= TOL, n
