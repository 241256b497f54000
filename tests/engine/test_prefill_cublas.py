"""--prefill-cublas: low-bit layers run prefill chunks (dense_prefill_rows+ rows) as dense matmuls over a weight
dequantized into one shared scratch buffer; decode keeps the low-bit GEMV. Same logits within the stated tolerance,
the same greedy tokens, and no memory per layer."""
import pytest
import torch

from engine.model.linear import DenseScratch, Linear, dense_cpu_dtype, dense_prefill_rows
from engine.model.llama import LlamaModel
from engine.model.loader import load_weights
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from kernels import cpu_native
from kernels.quant import QuantizedWeight, dequantize, quantize
from tests.engine.helpers import PAGE, make_engine, tiny_hf_model

ROWS = dense_prefill_rows(torch.device("cpu"))  # the runners here are the CPU's

# The low-bit kernels round activations, scales and zeros to bf16; the dense path multiplies in bf16 where the CPU
# does so natively, else in float32 (exact products, linear.dense_cpu_dtype): their logits differ by bf16 rounding. Measured (relative Frobenius
# error of the logits): tiny random models 1.3% (int8, int4), 0 (ternary: both round the same +-scale); SmolLM2
# (int4, a 300-token prompt) 2.0%, argmax the same at 99.3% of positions (for scale: the low-bit path itself is
# 1.5% from the same dense matmul in float32). Bound 3%; the argmax agrees wherever the top two logits are 0.5 apart (largest difference seen: 1.0).
TOLERANCE_TINY, TOLERANCE_DEFAULT, MARGIN = 0.03, 0.03, 0.5


def assert_close(on, off, tolerance):
    err = ((on - off).norm() / off.norm()).item()
    assert err < tolerance, err
    top2 = off.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > MARGIN
    assert torch.equal(on.argmax(-1)[clear], off.argmax(-1)[clear])
    return err


@pytest.mark.parametrize("fmt, group", [("int8", None), ("int8", 32), ("int4_asym", 32), ("int4_sym", 32),
                                        ("ternary", 64)])
def test_dequantize_in_place_is_dequantize(fmt, group):
    qw = quantize(torch.randn(96, 256), fmt, group)
    out = torch.full((96, 256), float("nan"))
    assert torch.equal(dequantize(qw, out=out), dequantize(qw, torch.float32))


def tiny_model(tmp_path, fmt):
    _, folder = tiny_hf_model("llama", tmp_path, seed=21, intermediate_size=256)
    return LlamaModel(load_weights(folder)[1], torch.float32, torch.device("cpu"), fmt)


def prefill_logits(model, ids, dense: bool):
    runner = ModelRunner(model, 8, torch.float32, PAGE, prefill_cublas=dense)
    try:
        return runner.run([Work(ids, 0, runner.pool.allocate(-(-len(ids) // PAGE)), "all")])[0], runner
    finally:
        for layer in model.layers:  # the model is shared: undo enable_dense_prefill
            for v in vars(layer).values():
                if isinstance(v, Linear):
                    v.scratch = None


@pytest.mark.parametrize("fmt", ["int8", "int4", "ternary"])
def test_tiny_model_prefill_logits_agree(tmp_path, fmt, one_thread):
    model = tiny_model(tmp_path, fmt)
    assert isinstance(model.layers[0].qkv.weight, QuantizedWeight)
    ids = torch.randint(0, 512, (150,)).tolist()
    off, _ = prefill_logits(model, ids, False)
    on, runner = prefill_logits(model, ids, True)
    assert_close(on, off, TOLERANCE_TINY)


def test_scratch_is_shared_and_reused(tmp_path, monkeypatch, one_thread):
    """One buffer for the whole model (float32; bf16 where the CPU multiplies bf16 natively, which the C++ pass writes
    straight, else beside the float32 one), sized for its largest layer, allocated once; chunks under
    ROWS rows (decode) never touch it; no dequantized weight is kept on any layer."""
    model = tiny_model(tmp_path, "int4")
    runner = ModelRunner(model, 8, torch.float32, PAGE, prefill_cublas=True)
    scratch = runner.dense_prefill
    linears = [v for layer in model.layers for v in vars(layer).values() if isinstance(v, Linear)]
    assert all(lin.scratch is scratch for lin in linears) and model.lm_head.scratch is None
    calls = []
    real = DenseScratch.weight
    monkeypatch.setattr(DenseScratch, "weight", lambda self, qw, dt: calls.append(qw) or real(self, qw, dt))
    pages = runner.pool.allocate(4)
    runner.run([Work(list(range(ROWS - 1)), 0, pages)])  # below the threshold: the low-bit path
    assert not calls and scratch.grown == 0
    runner.run([Work(list(range(100, 100 + 2 * ROWS)), 0, pages)])
    dtypes = {dense_cpu_dtype()} if cpu_native.loaded() else {torch.float32, dense_cpu_dtype()}
    assert len(calls) == len(linears) and scratch.grown == len(dtypes)
    biggest = max(lin.weight.out_features * lin.weight.in_features for lin in linears)
    assert {b.numel() for b in scratch.buffers.values()} == {biggest}
    assert set(scratch.buffers) == dtypes
    for step in range(3):  # later chunks and decode steps allocate nothing more
        runner.run([Work(list(range(ROWS)), 0, pages)])
        runner.run([Work([5], ROWS + step, pages)])
    assert scratch.grown == len(dtypes) and len(calls) == 4 * len(linears)
    assert all(not lin.weight.cache or all("dense" not in str(k) for k in lin.weight.cache) for lin in linears)


@pytest.fixture(scope="module")
def default_int4():
    model = LlamaModel(load_weights(None, native=True)[1], torch.float32, torch.device("cpu"), "int4")
    tokenizer_path = None
    return model, tokenizer_path


def test_default_model_prefill_logits_agree(default_int4):
    """SmolLM2-135M as stored (Q4_1 -> int4): a 300-token prefill's logits with and without the dense path."""
    from engine.model.default import default_model_path
    from engine.tokenizer import Tokenizer
    model, _ = default_int4
    tok = Tokenizer.from_gguf(default_model_path())
    text = "The history of the lighthouse is a story of engineering, weather and patience. " * 30
    ids = tok.encode(text)[:300]
    off, _ = prefill_logits(model, ids, False)
    on, _ = prefill_logits(model, ids, True)
    print("relative error", assert_close(on, off, TOLERANCE_DEFAULT))


PROMPTS = ["What is the capital of France? Answer in one sentence. " * 8, "Write a long story about a dragon.",
           "List three prime numbers and explain why they are prime. Then list three more and explain again."]
TIE = 0.25  # two bf16 steps of a logit near 26: the paths' rounding can reorder tokens this close


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_model_greedy_tokens_identical(default_int4, prompt):
    """40 greedy tokens after a prompt of 64+ tokens (one dense prefill chunk, then low-bit decode): identical; or,
    as in test_lowbit, parting only where the low-bit path's own logits (teacher-forced) put the two choices within
    TIE of each other, and not before 32 tokens."""
    from engine.model.default import default_model_path
    from engine.tokenizer import Tokenizer
    model, _ = default_int4
    tok = Tokenizer.from_gguf(default_model_path())
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    ids = (ids * (-(-ROWS // len(ids))))[:max(len(ids), ROWS)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    out = {}
    for dense in (False, True):
        runner = ModelRunner(model, 16, torch.float32, PAGE, prefill_cublas=dense)
        engine = make_engine(runner, max_concurrency=1)
        try:
            out[dense] = engine.generate(ids, params)
        finally:
            engine.shutdown()
            for layer in model.layers:
                for v in vars(layer).values():
                    if isinstance(v, Linear):
                        v.scratch = None
    ref, got = out[False], out[True]
    assert len(got) == 40
    if got == ref:
        return
    n = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    row = prefill_logits(model, ids + ref[:n], False)[0][-1]
    assert n >= 32 or row[ref[n]] - row[got[n]] <= TIE, (n, tok.decode(ref), tok.decode(got))
