"""A cancel during a long prefill step lands at the next layer boundary: the aborted sequence leaves the step (no layer
computes its rows after the abort was requested), its memory is back before the next layer runs, and the other
sequences of the same step (one decoding, one prefilling) produce what they produce in a run without the abort. On a
llama-family model and a Qwen3.5 hybrid (recurrent state slots and snapshots), with prefix reuse, and with KV tiers
(windowed page tables); the pools return to idle, and the aborted prompt sent again gets a cold run's answer (nothing
of the interrupted step was kept as reusable)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.build import build_engine
from engine.sampling import SamplingParams
from tests.engine.helpers import add_tokenizer, collect, tiny_hf_model
from tests.engine.qwen35_models import perturb, save_for_engine, tiny_config

CHUNK = 1024  # the prefill budget of a step
LONG, OTHER, DECODING = 1500, 300, 40  # prompt lengths: the aborted one, one prefilling beside it, one decoding
SECOND_CHUNK = LONG - CHUNK  # the long prompt's second step: its 476 tokens, the other prompt's 300, one decode row
ABORT_AT = 2  # the layer during which the abort is requested
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("abort-midstep")
    _, llama = tiny_hf_model("llama", root, seed=11, name="llama6", num_hidden_layers=6, max_position_embeddings=4096)
    add_tokenizer(llama, 512)
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(tiny_config()).eval()
    perturb(hf)
    return {"llama": (llama, 512), "qwen35": (save_for_engine(hf, root / "qwen35"), 256)}


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, vocab, n)]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def new_engine(folder, **settings):
    """An engine run step by step on the test's thread (Engine.step), invariants checked after every admission."""
    loaded = build_engine(folder, device="cpu", max_context=2048, max_concurrency=4, prefill_chunk=CHUNK, **settings)
    loaded.engine.memory.attention.check_admissions = True
    return loaded.engine


class LayerWatch:
    """Wraps every layer of the model: records each call (layer index, the q_len of every sequence in the batch);
    at layer `at` of the first step that computes a sequence's `trigger` tokens, calls `on_trigger`, and at the
    call after it records `then()`."""

    def __init__(self, model, trigger: int, at: int, on_trigger, then):
        self.calls: list[tuple[int, tuple[int, ...]]] = []
        self.triggered: int | None = None  # index of the call during which on_trigger ran
        self.after = None
        self.model = model
        self._inner = [layer.forward for layer in model.layers]
        for i, layer in enumerate(model.layers):
            layer.forward = self._wrap(i, layer.forward, trigger, at, on_trigger, then)

    def _wrap(self, i, inner, trigger, at, on_trigger, then):
        def forward(x, residual, ordinal, batch, *args):
            lens = tuple(s.q_len for s in batch.seqs)
            if self.triggered is not None and self.after is None:
                self.after = then()
            self.calls.append((i, lens))
            if self.triggered is None and i == at and trigger in lens:
                self.triggered = len(self.calls) - 1
                on_trigger()
            return inner(x, residual, ordinal, batch, *args)
        return forward

    def restore(self):
        for layer, inner in zip(self.model.layers, self._inner):
            layer.forward = inner


def run_scenario(engine, vocab: int, abort: bool):
    """One sequence decodes; then a long prompt and another arrive. The long prompt's first chunk fills a step; its
    second chunk runs in one step with the other prompt's prefill and the decode row. With `abort`, the long prompt
    is aborted while that step computes layer ABORT_AT. Returns the streams' (tokens, last output) and the watch."""
    decoding = engine.submit(tokens(1, DECODING, vocab), greedy())
    while engine.stats()["decode_tokens"] == 0:
        engine.step()
    long = engine.submit(tokens(2, LONG, vocab), greedy())
    other = engine.submit(tokens(3, OTHER, vocab), greedy())
    held = {}

    def on_trigger():
        seq = engine.scheduler.find(long.request_id)
        held.update(pages=len(seq.pages), free=engine.pool.num_free, aborted=engine.counters["aborted"])
        engine.abort(long.request_id)

    def then():
        return dict(free=engine.pool.num_free, aborted=engine.counters["aborted"],
                    running=[s.request_id for s in engine.scheduler.running])

    watch = LayerWatch(engine.runner.model, SECOND_CHUNK, ABORT_AT, on_trigger if abort else lambda: None, then)
    try:
        while engine.step():
            pass
    finally:
        watch.restore()
    watch.held = held
    return [collect(s, timeout=1) for s in (long, other, decoding)], watch


def assert_idle(engine):
    s = engine.stats()
    assert (s["running"], s["waiting"]) == (0, 0)
    assert s["pages_free"] == s["pages_total"], s  # idle cached prefix pages count as free
    if "state_slots_total" in s:
        assert s["state_slots_free"] == s["state_slots_total"] and engine.memory.state._pending == 0, s
    assert s["kv_host_pages_used"] == 0, s  # the host prefix store's pages are idle


CASES = {
    "llama": ("llama", {}),
    "llama-no-prefix-cache": ("llama", {"max_shared_prefixes": 0}),
    "llama-kv-tiers": ("llama", {"kv_window": 256, "kv_retrieve": 256, "host_kv_mib": 64}),
    "qwen35": ("qwen35", {}),
    "qwen35-no-prefix-cache": ("qwen35", {"max_shared_prefixes": 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_abort_mid_step_stops_the_sequence_at_the_next_layer_and_spares_the_others(folders, case):
    name, settings = CASES[case]
    folder, vocab = folders[name]
    reference, _ = run_scenario(new_engine(folder, **settings), vocab, abort=False)
    engine = new_engine(folder, **settings)
    (long, other, decoding), watch = run_scenario(engine, vocab, abort=True)

    assert long[0] == [] and long[1].finish_reason == "abort"
    # the other two sequences of that step answer as without the abort
    assert other[0] == reference[1][0] and decoding[0] == reference[2][0]
    assert len(other[0]) == len(decoding[0]) == NEW_TOKENS

    # work done for the aborted sequence after the abort: none (the layer in progress finishes, no later one has it)
    assert watch.triggered is not None
    later = watch.calls[watch.triggered + 1:]
    assert SECOND_CHUNK in watch.calls[watch.triggered][1]
    assert all(SECOND_CHUNK not in lens for _, lens in later)
    # the same step goes on for the others, and the abort had landed before its next layer ran
    assert later[0] == (ABORT_AT + 1, (1, OTHER))
    assert watch.after["aborted"] == watch.held["aborted"] + 1
    assert watch.after["free"] >= watch.held["free"] + watch.held["pages"]
    assert len(watch.after["running"]) == 2

    assert_idle(engine)
    # the aborted prompt sent again gets the answer of a run that never saw the abort
    stream = engine.submit(tokens(2, LONG, vocab), greedy())
    while engine.step():
        pass
    assert collect(stream, timeout=1)[0] == reference[0][0]
    assert_idle(engine)


def test_an_abort_from_another_thread_stops_a_running_step(folders):
    """The engine on its own thread; the abort comes from the caller's thread while the step is inside a layer
    (the layer waits for it): the step computes no later layer, and the stream ends with "abort"."""
    folder, vocab = folders["llama"]
    engine = new_engine(folder, max_shared_prefixes=0)
    inside, go_on = threading.Event(), threading.Event()
    watch = LayerWatch(engine.runner.model, CHUNK, ABORT_AT, lambda: (inside.set(), go_on.wait(30)), lambda: None)
    try:
        engine.start()
        stream = engine.submit(tokens(2, LONG, vocab)[:CHUNK], greedy())
        assert inside.wait(60)
        calls = len(watch.calls)
        stream.abort()
        go_on.set()
        toks, last = collect(stream, timeout=60)
        assert (toks, last.finish_reason) == ([], "abort")
        engine.shutdown()
    finally:
        go_on.set()
        watch.restore()
        engine.shutdown()
    assert len(watch.calls) == calls  # not one more layer after the abort
    assert_idle(engine)
