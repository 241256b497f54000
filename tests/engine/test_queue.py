"""The bounded queue: running + waiting requests never exceed --max-concurrency + --max-queue."""
import pytest
import torch

from engine.engine import Engine, QueueFullError
from engine.model.llama import LlamaModel
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from tests.engine.helpers import tiny_hf_model


def test_submit_beyond_concurrency_plus_queue_is_refused_then_accepted_again(tmp_path):
    from engine.model.loader import load_weights
    _, folder = tiny_hf_model("llama", tmp_path)
    _, weights = load_weights(folder)
    runner = ModelRunner(LlamaModel(weights, torch.float32, torch.device("cpu")), 32, torch.float32)
    engine = Engine(runner, max_concurrency=1, prefill_chunk=64, max_context=512, max_queue=1, max_shared_prefixes=0).start()
    try:
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        a = engine.submit([1, 2, 3], long)
        b = engine.submit([4, 5, 6], long)
        with pytest.raises(QueueFullError) as e:
            engine.submit([7, 8], long)
        assert "--max-queue" in str(e.value)
        a.abort()
        b.abort()
        list(a), list(b)  # both end (aborted), releasing their slots
        out = engine.generate([7, 8], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out) == 3
    finally:
        engine.shutdown()


def test_a_request_that_fails_while_being_built_holds_no_queue_slot(tmp_path, monkeypatch):
    """A failure between validation and queueing (here: the sequence's sampler cannot be built) gives back nothing
    because it never took a slot: the queue's capacity stays whole."""
    import engine.engine as engine_module
    from engine.model.loader import load_weights

    _, weights = load_weights(tiny_hf_model("llama", tmp_path)[1])
    runner = ModelRunner(LlamaModel(weights, torch.float32, torch.device("cpu")), 32, torch.float32)
    engine = Engine(runner, max_concurrency=1, prefill_chunk=64, max_context=512, max_queue=1, max_shared_prefixes=0)
    real = engine_module.Sequence

    def failing(*args, **kwargs):
        raise OverflowError("cannot build the sampler")

    monkeypatch.setattr(engine_module, "Sequence", failing)
    for _ in range(5):
        with pytest.raises(OverflowError):
            engine.submit([1, 2, 3], SamplingParams(max_tokens=1))
    monkeypatch.setattr(engine_module, "Sequence", real)
    streams = [engine.submit([1, 2, 3], SamplingParams(max_tokens=1)) for _ in range(2)]  # concurrency 1 + queue 1
    assert len(streams) == 2
    with pytest.raises(QueueFullError):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=1))
