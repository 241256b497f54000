"""--cpu-compile step (engine/model/cpu_step.py): a decode step of one sequence runs as one compiled graph. On a
llama-family model and a Qwen3.5 hybrid: the greedy tokens are transformers' and the eager path's, each decode
step's logits are the eager step's within 1e-5 relative (within a bf16 rounding's reach for int4), one graph serves
every length and every sequence, and a machine where compiling fails decodes eagerly after one log line."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.engine import Engine
from engine.memory.kv.table import PageList
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from tests.engine.helpers import hf_greedy, rel_err, tiny_hf_model


PAGE = 64
NUM_PAGES = 8


def runner_for(model, cpu_step: bool) -> ModelRunner:
    slots = 2 if any(s.kind == "recurrent" for s in model.cache_specs) else 0
    return ModelRunner(model, NUM_PAGES, torch.float32, PAGE, state_slots=slots, max_batch=1, cpu_step=cpu_step)


@pytest.fixture(scope="module", params=["qwen3", "qwen35", "qwen3-int4"])
def case(request, tmp_path_factory, tiny_qwen35):
    """(transformers model, our model, a runner with the compiled step, one without). qwen3-int4: the weights in
    int4, whose kernels fill lazy caches on their first call (the oracle is then the eager path alone)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen35":
        hf, path = tiny_qwen35(seed=3)
    else:
        hf, path = tiny_hf_model("qwen3", folder, seed=3)
    low_bit = request.param.endswith("int4")
    model = build_model(load_weights(path)[1], torch.float32, torch.device("cpu"), "int4" if low_bit else "")
    return (None if low_bit else hf), model, runner_for(model, True), runner_for(model, False)


def greedy(hf, prompt: list[int], n: int, eager: list[int]) -> list[int]:
    """transformers' greedy tokens, or for a low-bit model (which transformers does not run) the eager path's."""
    return eager if hf is None else hf_greedy(hf, prompt, n)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, vocab, n)]


def decode(runner: ModelRunner, prompt: list[int], n: int, pages: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy: the prompt in one step, then n - 1 decode steps; the tokens and each decode step's logits."""
    pages, state = PageList(pages, PAGE), None
    if runner.state is not None:
        from engine.memory.state import SeqState
        slot = runner.state.allocate()
        runner.state.zero(slot)
        state = SeqState(slot)
    try:
        logits = runner.run([Work(prompt, 0, pages, state=state)])[0][-1]
        out, steps = [int(logits.argmax())], []
        for i in range(n - 1):
            logits = runner.run([Work([out[-1]], len(prompt) + i, pages, state=state)])[0][-1]
            steps.append(logits.clone())
            out.append(int(logits.argmax()))
        return out, steps
    finally:
        if state is not None:
            runner.state.free([state.slot])


def test_compiled_steps_match_eager_and_transformers_across_lengths_and_sequences(case):
    """Two sequences on different pages, their decode crossing page boundaries (positions 40..103 and 57..120):
    every step runs compiled, through the one graph compiled when the runner was built."""
    hf, model, compiled, eager = case
    vocab = model.cfg.vocab_size
    # int4: the ATen kernel takes activations rounded to bf16, and the graph's fused norm can land an activation on
    # the other side of a bf16 rounding than the eager one (measured: up to 7.5e-3 on AVX-512, 0 on AVX2). That
    # rounding's own effect on a step is larger (1e-2 to 2e-2 median against float32 activations); the graph of
    # another model's weights is 1.5 away.
    bound = 2e-2 if hf is None else 1e-5
    for seed, length, first_page in ((1, 41, 0), (2, 58, 3)):
        prompt = tokens(seed, length, vocab)
        pages = list(range(first_page, first_page + 3))
        before = compiled.graphs.compiled.steps
        got, got_logits = decode(compiled, prompt, 64, pages)
        want, want_logits = decode(eager, prompt, 64, pages)
        assert compiled.graphs.compiled.steps - before == 63
        assert got == want == greedy(hf, prompt, 64, want)
        worst = max(rel_err(a, b) for a, b in zip(got_logits, want_logits))
        assert worst <= bound, worst
    assert compiled.graphs.compiled.compiles == 1


def test_a_sequence_on_pages_that_are_not_consecutive_decodes_through_the_static_forward(case):
    hf, model, compiled, eager = case
    prompt = tokens(5, 70, model.cfg.vocab_size)  # past the first page: pages 5 and 1 from the start
    before = compiled.graphs.compiled.steps
    got, _ = decode(compiled, prompt, 30, [5, 1, 6])
    assert compiled.graphs.compiled.steps == before  # the step took none of them
    want = decode(eager, prompt, 30, [5, 1, 6])[0]
    assert got == want == greedy(hf, prompt, 30, want)


def test_the_engine_generates_the_same_text_with_and_without_the_compiled_step(case):
    hf, model, compiled, eager = case
    prompt = tokens(9, 70, model.cfg.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = []
    for runner in (compiled, eager):
        engine = Engine(runner, max_concurrency=1, prefill_chunk=512, max_context=NUM_PAGES * PAGE,
                        max_shared_prefixes=0).start()
        try:
            outs.append(engine.generate(prompt, params))
        finally:
            engine.shutdown()
    assert outs[0] == outs[1] == greedy(hf, prompt, 40, outs[1])


def test_a_failed_compile_falls_back_to_eager_decoding_with_one_log_line(case, monkeypatch, caplog):
    """As on a machine without a C++ compiler: inductor's compile raises; the runner says why, once, and decodes."""
    import torch._inductor.compile_fx as compile_fx

    hf, model, _, eager = case

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compile_fx, "compile_fx", no_compiler)
    with caplog.at_level(logging.WARNING, logger="ninfer.model"):
        runner = runner_for(model, True)
    lines = [r.getMessage() for r in caplog.records if "--cpu-compile step" in r.getMessage()]
    assert len(lines) == 1 and "No working C++ compiler" in lines[0], lines
    assert runner.graphs.compiled is None
    prompt = tokens(11, 30, model.cfg.vocab_size)
    assert decode(runner, prompt, 12, [0, 1])[0] == decode(eager, prompt, 12, [0, 1])[0]
