"""--cpu-compile on the default model: the compiled output layer (engine/model/head.py) against the dense float32
one (--cpu-compile off): identical greedy tokens, logits equal within 1e-5 relative. The decoder layers of both
decode through the same C++ kernel (auto marks them; the off engine's are marked here), so the output layer is the
only difference (the off engine also gets auto's dense prompt path here)."""
import pytest
import torch

from engine.model.head import CompiledHead
from engine.model.linear import Linear, dense_prefill_rows, enable_dense_prefill, use_cpu_kernel
from engine.runner import Work
from engine.sampling import SamplingParams

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a long story about a dragon."]


@pytest.fixture(scope="module")
def engines(engine_for):
    made = {mode: engine_for(None, cpu_compile=mode, max_concurrency=1, max_context=1024, own_model=mode == "off")
            for mode in ("auto", "off")}  # the "off" model is changed below: its own
    off = made["off"].engine.runner
    use_cpu_kernel(off.model)  # auto's decode kernel and dense prompt path, so that the output layer is the difference
    off.dense_prefill = enable_dense_prefill(off.model, dense_prefill_rows(torch.device("cpu")))
    for le in made.values():
        le.engine.start()
    yield made
    for le in made.values():
        le.engine.shutdown()


def last_logits(le, ids: list[int]) -> torch.Tensor:
    runner = le.engine.runner
    pages = runner.pool.allocate(runner.pool.pages_for(len(ids)))
    try:
        return runner.run([Work(ids, 0, pages)])[0][-1]
    finally:
        runner.pool.deallocate(pages)


def test_auto_compiles_the_output_layer_and_off_keeps_it_dense(engines):
    compiled, dense = (engines[m].engine.runner.model.lm_head for m in ("auto", "off"))
    assert isinstance(compiled, CompiledHead) and compiled.weight.qweight.dtype == torch.int8
    assert type(dense) is Linear and dense.weight.dtype == torch.float32
    assert compiled.nbytes < 0.3 * dense.nbytes  # the bytes a decode step reads for the logits


@pytest.mark.parametrize("prompt", PROMPTS)
def test_compiled_and_eager_give_identical_greedy_tokens_and_logits(engines, prompt):
    tok = engines["auto"].tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    got, want = (engines[m].engine.generate(ids, params) for m in ("auto", "off"))
    assert got == want, (tok.decode(got), tok.decode(want))
    for n in (0, 17, 47):  # teacher-forced over the answer
        a, b = (last_logits(engines[m], ids + want[:n]) for m in ("auto", "off"))
        assert a.dtype == b.dtype == torch.float32
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


def test_a_prompt_longer_than_a_prefill_chunk(engines):
    """The first chunk of a 700-token prompt asks the output layer for no row at all (no sequence ends there)."""
    ids = list(range(1000, 1700))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got, want = (engines[m].engine.generate(ids, params) for m in ("auto", "off"))
    assert got == want and len(got) == 8


def test_the_fused_decode_step_picks_the_eager_steps_tokens(engines):
    """auto decodes each step as one C++ call (kernels/cpu_decode.cpp), off layer by layer. Both round activations to
    int16 before each GEMV, so a last-bit difference upstream (RoPE rounded once in C++, twice in ATen) can move a
    rounded value one step: their decode logits differ by a few 1e-4 of the largest (each stays within ~1e-3 of the
    exact products, tests/engine/test_cpu_fused.py), and every step's token is the same."""
    tok = engines["auto"].tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}])
    answer = engines["off"].engine.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    seq = ids + answer
    steps = {}
    for mode in ("auto", "off"):
        runner = engines[mode].engine.runner
        fused_before = runner.graphs.fused.steps if runner.graphs.fused is not None else 0
        pages = runner.pool.allocate(runner.pool.pages_for(len(seq)))
        try:
            runner.run([Work(seq[:len(ids)], 0, pages)])
            steps[mode] = [runner.run([Work([seq[i]], i, pages)])[0][-1] for i in range(len(ids), len(seq))]
        finally:
            runner.pool.deallocate(pages)
        if mode == "auto":
            assert runner.graphs.fused.steps - fused_before == len(answer)  # every step was the C++ call
    for a, b in zip(steps["auto"], steps["off"]):
        assert int(a.argmax()) == int(b.argmax())
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-3
