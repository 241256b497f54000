"""The memory seam end to end with a stand-in recurrent layer kind (tests/engine/recurrent_model.py): the KV cache
holds only the attention layers, the state pool the recurrent ones; admission, preemption, aborts, prefix reuse
and speculative rollback all go through engine/memory/, and every output is checked against a reference forward
that knows nothing of pages or slots."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from engine.engine import Engine
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Speculator
from tests.engine.helpers import abort_storm, collect, rel_err, run_concurrently, wait_idle
from tests.engine.recurrent_model import KINDS, RecurrentTestModel, hybrid_weights, reference_logits

PAGE = 64


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return hybrid_weights(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def model(weights):
    return RecurrentTestModel(weights, torch.float32, torch.device("cpu"))


def engine_over(model, *, num_pages=16, state_slots=8, max_concurrency=4, snapshots=0, prefix=0, speculator=None,
                prefill_chunk=512, runner_hook=None):
    runner = ModelRunner(model, num_pages, torch.float32, PAGE, state_slots=state_slots)
    return Engine(runner_hook(runner) if runner_hook else runner, max_concurrency=max_concurrency,
                  prefill_chunk=prefill_chunk, max_context=num_pages * PAGE, max_shared_prefixes=prefix,
                  state_snapshots=snapshots, speculator=speculator).start()


def reference_greedy(weights, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference_logits(weights, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, vocab, n)]


def test_layer_kinds_size_the_kv_cache_and_the_state_pool(model):
    runner = ModelRunner(model, 8, torch.float32, PAGE, state_slots=3)
    assert [s.kind for s in model.cache_specs] == list(KINDS)
    assert runner.kv.num_layers == KINDS.count("attention") == 2  # KV for the attention layers only
    assert len(runner.state.layers) == KINDS.count("recurrent") == 2
    d = model.cfg.hidden_size
    assert runner.state.layers[0]["sum"].shape == (3, d) and runner.state.layers[1]["window"].shape == (3, 2, d)
    assert runner.state.slot_bytes == 2 * (d + 2 * d) * 4
    with pytest.raises(ValueError, match="state_slots"):
        ModelRunner(model, 8, torch.float32, PAGE)


def test_chunked_prefill_and_decode_match_the_reference(model, weights):
    """Chunks of odd sizes that cross page boundaries, then decode: the state carries over between steps."""
    runner = ModelRunner(model, 8, torch.float32, PAGE, state_slots=2)
    tokens = prompt(1, 150)
    pages, slot = runner.pool.allocate(3), runner.state.allocate()
    from engine.memory.state import SeqState
    state, rows, start = SeqState(slot), [], 0
    for n in (37, 64, 29, 19, 1):
        rows.append(runner.run([Work(tokens[start:start + n], start, pages, "all", state)])[0])
        start += n
    ours = torch.cat(rows)
    ref = reference_logits(weights, tokens[:start])
    assert rel_err(ours, ref) <= 1e-5


def test_batched_sequences_each_match_the_reference(model, weights):
    engine = engine_over(model)
    try:
        prompts = [prompt(10 + i, 20 + 37 * i) for i in range(4)]
        results = run_concurrently(engine, prompts, [greedy(24)] * 4)
        for p, (tokens, last) in zip(prompts, results):
            assert tokens == reference_greedy(weights, p, 24)
        idle = wait_idle(engine)
        assert idle["pages_free"] == idle["pages_total"] and idle["state_slots_free"] == idle["state_slots_total"]
    finally:
        engine.shutdown()


class _Watch:
    """A runner wrapper recording how many sequences hold a state slot at each step."""

    def __init__(self, runner):
        self.runner, self.pools, self.pool, self.kv, self.state = runner, runner.pools, runner.pool, runner.kv, runner.state
        self.holding: list[int] = []

    def run(self, works):
        self.holding.append(self.state.num_slots - self.state.num_free)
        return self.runner.run(works)


def test_admission_counts_state_slots(model, weights):
    """Two slots, four requests allowed to run: never more than two hold state, and all four finish right."""
    watch = None

    def hook(runner):
        nonlocal watch
        watch = _Watch(runner)
        return watch

    engine = engine_over(model, state_slots=2, max_concurrency=4, runner_hook=hook)
    try:
        prompts = [prompt(20 + i, 30) for i in range(4)]
        results = run_concurrently(engine, prompts, [greedy(8)] * 4)
        assert [r[0] for r in results] == [reference_greedy(weights, p, 8) for p in prompts]
        assert max(watch.holding) == 2 and len(watch.holding) > 8
    finally:
        engine.shutdown()


def test_preemption_and_recompute_give_identical_output(model, weights):
    """Four sequences that outgrow a 6-page pool: some are preempted (state released) and recomputed from zero."""
    engine = engine_over(model, num_pages=6, state_slots=4)
    try:
        prompts = [prompt(30 + i, 40) for i in range(4)]
        results = run_concurrently(engine, prompts, [greedy(40)] * 4)
        assert engine.stats()["preemptions"] > 0
        for p, (tokens, _) in zip(prompts, results):
            assert tokens == reference_greedy(weights, p, 40)
        idle = wait_idle(engine)
        assert idle["pages_free"] == 6 and idle["state_slots_free"] == 4
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_random_aborts_leave_both_pools_whole(model):
    engine = engine_over(model, num_pages=12, state_slots=6, snapshots=2, prefix=4)
    try:
        idle = abort_storm(engine, lambda i, rng: prompt(100 + i % 13, rng.randint(5, 140)),
                           lambda rng: greedy(rng.randint(1, 12)), seed=7)
        assert idle["aborted"] > 20
        assert idle["pages_free"] == idle["pages_total"] == 12  # idle cached prefix pages count as free
        # snapshots live in host memory: every device slot is free, and the host buffers stay within the budget
        assert idle["state_slots_free"] == engine.runner.state.num_free == 6
        assert idle["state_snapshot_host_bytes"] <= 2 * idle["state_slot_bytes"]
    finally:
        engine.shutdown()


def test_prefix_reuse_restores_a_state_snapshot(model, weights):
    """A resent prompt reuses its cached pages as deep as a snapshot exists, with logits identical to a cold run."""
    engine = engine_over(model, num_pages=16, snapshots=8, prefix=4)
    try:
        first = prompt(40, 200)
        tokens, _ = collect(engine.submit(first, greedy(4)))
        resent = first + tokens + prompt(41, 30)
        params = greedy(6, logprobs=5)
        warm, last = collect(engine.submit(resent, params))
        s = engine.stats()
        assert s["state_snapshot_hits"] == 1 and s["prefix_hit_tokens"] == 192  # 3 full pages of the first prompt
        assert warm == reference_greedy(weights, resent, 6)
        # the same request cold, on a fresh engine: the same tokens and logprobs
        cold_engine = engine_over(model, num_pages=16)
        try:
            cold, cold_last = collect(cold_engine.submit(resent, params))
        finally:
            cold_engine.shutdown()
        assert cold == warm
    finally:
        engine.shutdown()


def test_prefix_without_a_snapshot_is_recomputed_and_counted(model, weights, caplog):
    engine = engine_over(model, num_pages=16, snapshots=0, prefix=4)
    try:
        first = prompt(50, 200)
        collect(engine.submit(first, greedy(2)))
        with caplog.at_level("INFO", logger="ninfer.state"):
            tokens, _ = collect(engine.submit(first + [7, 8, 9], greedy(6)))
        s = engine.stats()
        assert s["prefix_hit_tokens"] == 0 and s["state_snapshot_misses"] >= 1
        assert "has no recurrent-state snapshot" in caplog.text
        assert tokens == reference_greedy(weights, first + [7, 8, 9], 6)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_speculative_rollback_restores_the_state_and_stays_lossless(model):
    """ngram drafts on a repetitive prompt, every step (adaptive off, so the test does not depend on timing):
    rejected drafts roll the state back; 128 greedy tokens are identical to decoding without speculation."""
    p = (prompt(60, 24) * 5)[:110]
    plain = engine_over(model, num_pages=8)
    try:
        expected, _ = collect(plain.submit(p, greedy(128)), timeout=300)
    finally:
        plain.shutdown()
    spec = Speculator(NgramProposer(), 4, adaptive=False)
    engine = engine_over(model, num_pages=8, state_slots=8, speculator=spec)
    try:
        tokens, _ = collect(engine.submit(p, greedy(128)), timeout=300)
        s = engine.stats()
        assert s["spec_drafted"] > s["spec_accepted"] > 0  # drafts were made, some kept and some rejected
        assert s["state_rollbacks"] > 0
        assert tokens == expected
        idle = wait_idle(engine)
        assert idle["state_slots_free"] == 8 and idle["pages_free"] == 8
    finally:
        engine.shutdown()


def test_a_hybrid_folder_builds_and_the_ledger_counts_what_the_engine_allocates(weights, tmp_path, monkeypatch):
    """build_engine on a folder of the stand-in hybrid (config.json layer_types): the KV pool covers the attention
    layers only, the state pool holds one slot per sequence (the prefix snapshots are in host memory), and the ledger
    the engine was sized with counts exactly those pages and state bytes, the snapshots on the host."""
    from engine.build import build_engine
    from engine.model.config import HF_ARCHS
    from tests.engine.recurrent_model import HF_NAME, write_hybrid_folder

    monkeypatch.setitem(HF_ARCHS, HF_NAME, "test-recurrent")
    folder = tmp_path / "hybrid"
    write_hybrid_folder(weights, folder)
    loaded = build_engine(folder, device="cpu", kv_capacity=1024, max_concurrency=3, max_context=512)
    try:
        runner, ledger = loaded.engine.runner, loaded.ledger
        assert loaded.config.layer_kinds == KINDS
        assert runner.kv.num_layers == 2 and runner.pool.num_pages == ledger.gpu_pages == 16
        assert ledger.page_bytes == runner.kv.page_bytes  # KV of the two attention layers only
        assert runner.state.num_slots == 3  # three sequences
        assert ledger.line("state").bytes == runner.state.num_slots * runner.state.slot_bytes
        snaps = ledger.line("state_snapshots")  # up to two prefix snapshots a sequence (reuse is on), on the host
        assert snaps.device == "host" and snaps.bytes == 6 * runner.state.slot_bytes
        assert loaded.engine.memory.state.max_snapshots == 6
        assert "2 linear layers" in ledger.line("state").name
        tokens = loaded.engine.start().generate(prompt(70, 90), greedy(6))
        assert tokens == reference_greedy(weights, prompt(70, 90), 6)
    finally:
        loaded.engine.shutdown()
