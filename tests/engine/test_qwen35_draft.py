"""`--spec draft` with a Gated-DeltaNet hybrid as the draft model (a small Qwen3.5 drafting for a Qwen3.5 target):
the drafter's recurrent state goes back to its checkpoint when the target rejects drafts, so greedy output is the
output without speculation, and the drafter's state slots all come back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.build import build_engine
from engine.sampling import SamplingParams
from tests.engine.helpers import run_concurrently, wait_idle
from tests.engine.qwen35_models import VOCAB, perturb, save_for_engine, tiny_config


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM

    root = tmp_path_factory.mktemp("qwen35-draft")
    out = []
    for seed, name, layers in ((0, "target", 8), (5, "drafter", 4)):
        torch.manual_seed(seed)
        hf = Qwen3_5ForCausalLM(tiny_config(num_hidden_layers=layers,
                                            layer_types=(["linear_attention"] * 3 + ["full_attention"])
                                            * (layers // 4))).eval()
        perturb(hf)
        out.append(save_for_engine(hf, root / name))
    return out


def prompts() -> list[list[int]]:
    return [[int(t) for t in np.random.default_rng(70 + i).integers(2, VOCAB, 30 + 17 * i)] for i in range(2)]


def generate(folder, n: int, record: list | None = None, **kw) -> tuple[list[list[int]], dict]:
    """Greedy output of two requests at once; `record` collects (the sequence's tokens, the drafts proposed)."""
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=2, max_shared_prefixes=0, **kw)
    engine = loaded.engine
    if engine.speculator is not None:
        engine.speculator.adaptive = False  # draft every step, however often the target rejects
        proposer, propose = engine.speculator.proposer, engine.speculator.proposer.propose

        def recording(requests):
            out = propose(requests)
            record.extend((list(seq.tokens), d) for (seq, _), d in zip(requests, out) if d)
            return out

        proposer.propose = recording
    try:
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = [out for out, _ in run_concurrently(engine, prompts(), [params] * 2)]
        stats = wait_idle(engine)
        if engine.speculator is not None:
            states = engine.speculator.proposer.states
            stats["draft_slots_free"], stats["draft_slots_total"] = states.num_free, states.num_slots
        return outs, stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize("drafter", ["other", "same"])
def test_a_hybrid_drafter_is_lossless_and_returns_its_state_slots(folders, drafter, one_thread):
    """Another random hybrid drafts (most drafts rejected: the drafter's state rolls back nearly every step), and the
    target drafts for itself (most accepted): 96 greedy tokens per request, two requests at once, equal the output
    without speculation; every draft is the drafter's own greedy continuation of the sequence so far (transformers
    on the drafter's checkpoint), which a state left past a rejection would not give."""
    from transformers import Qwen3_5ForCausalLM

    target, other = folders
    draft_folder = other if drafter == "other" else target
    expected, _ = generate(target, 96)
    record: list = []
    got, s = generate(target, 96, record, spec="draft", draft_model=str(draft_folder), draft_tokens=3)
    assert got == expected
    assert s["spec_drafted"] > 0 and s["draft_slots_free"] == s["draft_slots_total"] == 4
    if drafter == "same":
        assert s["spec_accepted"] / s["spec_drafted"] > 0.9
    else:
        assert s["spec_accepted"] < s["spec_drafted"]
    hf = Qwen3_5ForCausalLM.from_pretrained(draft_folder).eval()
    for tokens, drafts in record[:: max(1, len(record) // 12)]:
        ref = hf.generate(torch.tensor([tokens]), do_sample=False, max_new_tokens=len(drafts),
                          min_new_tokens=len(drafts))
        assert drafts == ref[0, len(tokens):].tolist()
