"""The GDN layers' compiled CPU decode step (kernels/gdn_cpu.py) in the model, against transformers'
Qwen3_5ForCausalLM on a tiny checkpoint: the same greedy tokens and decode logits, every decode step of every GDN
layer through it; where it cannot be built, one warning and the eager path."""
from __future__ import annotations

import logging

import pytest
import torch

from kernels.gdn_cpu import GDNDecode


@pytest.fixture(scope="module")
def compiled_model(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint loaded with the compiled step (the size bar lowered for it), and transformers."""
    from engine.model import gdn
    from tests.engine.qwen35_models import tiny_checkpoint

    hf, folder = tiny_checkpoint(tmp_path_factory.mktemp("gdn-cpu") / "tiny", seed=3)
    bar, gdn.COMPILE_MIN_WEIGHTS = gdn.COMPILE_MIN_WEIGHTS, 0
    try:
        from engine.build import build_engine

        loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=2)
    finally:
        gdn.COMPILE_MIN_WEIGHTS = bar
    yield hf, loaded
    loaded.engine.shutdown()


def test_a_hybrid_decodes_through_the_compiled_step_as_transformers_does(compiled_model):
    from engine.sampling import SamplingParams

    hf, loaded = compiled_model
    model = loaded.engine.runner.model
    step = model.gdn_step
    assert step is not None and all(layer.compiled_step is step for layer in model.layers
                                    if layer.cache_spec.kind == "recurrent")
    before = step.calls
    engine = loaded.engine.start()
    prompt = [int(t) for t in torch.randint(2, 256, (45,), generator=torch.Generator().manual_seed(1))]
    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48, min_new_tokens=48)
    assert out == ref[0, len(prompt):].tolist()
    recurrent = sum(layer.cache_spec.kind == "recurrent" for layer in model.layers)
    assert step.calls - before == 47 * recurrent  # every decode step after the prompt's, in every GDN layer


def test_decode_logits_through_the_compiled_step_match_transformers(compiled_model):
    from engine.memory.state import SeqState
    from engine.runner import Work
    from tests.engine.helpers import rel_err

    hf, loaded = compiled_model
    runner = loaded.engine.runner
    ids = [int(t) for t in torch.randint(2, 256, (70,), generator=torch.Generator().manual_seed(2))]
    pages, state = runner.pool.allocate(2), SeqState(runner.state.allocate())
    runner.state.zero(state.slot)
    try:
        rows = [runner.run([Work(ids[:60], 0, pages, "all", state)])[0]]
        rows += [runner.run([Work([t], 60 + i, pages, "last", state)])[0] for i, t in enumerate(ids[60:])]
    finally:
        runner.pool.deallocate(pages)
        runner.state.free([state.slot])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(torch.cat(rows), want) <= 1e-4


def test_a_step_that_cannot_be_built_leaves_the_eager_path_with_one_warning(monkeypatch, caplog):
    from engine.model import gdn
    from engine.model.config import LinearAttentionConfig

    monkeypatch.setattr(GDNDecode, "_check", lambda self, *a: "the compiled GDN step differs from its twin")
    monkeypatch.setattr(gdn, "COMPILE_MIN_WEIGHTS", 0)
    # the fields of a ModelConfig it reads
    cfg = type("Cfg", (), {"linear": LinearAttentionConfig(2, 6, 16, 8, 4), "hidden_size": 32, "rms_eps": 1e-6})
    with caplog.at_level(logging.WARNING, logger="ninfer.model"):
        assert gdn.compiled_gdn_step(cfg, torch.float32, "float32", torch.device("cpu"), "auto") is None
    warnings = [r for r in caplog.records if "compiled CPU decode step is not available" in r.getMessage()]
    assert len(warnings) == 1 and "differs from its twin" in warnings[0].getMessage()
    assert "--cpu-compile off" in warnings[0].getMessage()
    assert gdn.compiled_gdn_step(cfg, torch.float32, "float32", torch.device("cpu"), "off") is None
