"""Low-bit weights in the model: GGUF Q4_1 kept as stored, quantize-at-load for HF folders, same greedy tokens."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from engine.model.default import default_model_path
from engine.model.llama import LlamaModel
from engine.model.loader import load_weights
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from kernels.quant import QuantizedWeight, dequantize
from tests.engine.helpers import tiny_hf_model

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a long story about a dragon.",
           "List three prime numbers and explain why they are prime."]


@pytest.fixture(scope="module")
def native_weights():
    return load_weights(None, native=True)[1]


def test_native_load_keeps_q4_1_blocks_exactly(native_weights):
    reader = GGUFReader(default_model_path())
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    qw = native_weights.tensors["model.layers.3.mlp.down_proj.weight"]
    assert isinstance(qw, QuantizedWeight) and qw.format == "int4_asym" and qw.group_size == 32
    ref = gguf_dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(qw.shape)
    assert torch.equal(dequantize(qw, torch.float32), torch.from_numpy(np.ascontiguousarray(ref)).float())


def test_native_q_k_rows_are_unpermuted_like_the_dense_path(native_weights):
    dense = load_weights(None)[1]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(dequantize(native_weights.tensors[name], torch.float32), dense.tensors[name])


@pytest.fixture(scope="module")
def engines(engine_for):
    made = {wd: engine_for(None, weight_dtype=wd, max_concurrency=1, max_context=1024) for wd in ("fp32", "int4")}
    for le in made.values():
        le.engine.start()
    yield made
    for le in made.values():
        le.engine.shutdown()


def test_auto_runs_the_default_model_as_int4_and_reads_far_fewer_bytes(engine_for, engines):
    auto = engine_for(None, max_concurrency=1, max_context=256)
    assert auto.engine.runner.model.weight_format == "int4"
    fp32, int4 = (engines[w].engine.runner.model for w in ("fp32", "int4"))
    layers = lambda m: m.weight_bytes() - m.lm_head.nbytes  # noqa: E731
    assert layers(int4) < 0.2 * layers(fp32), (layers(int4), layers(fp32))
    # the output layer (the tied Q8_0 embedding) keeps the file's codes on the CPU: they decode to exactly the fp32
    # run's weight, and its logits are float32 products (engine/model/head.py), not bf16 ones
    from engine.model.head import CompiledHead, embed_rows
    from kernels.quant import dequantize

    head = int4.lm_head
    assert isinstance(head, CompiledHead) and torch.equal(dequantize(head.weight), fp32.lm_head.weight)
    assert head.nbytes < 0.3 * fp32.lm_head.nbytes
    x = torch.randn(3, fp32.cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    want = x @ fp32.lm_head.weight.T
    for rows in (x[:1], x):
        got = head(rows)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want[:len(rows)], rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # the embedding rows decode to the fp32 run's rows
    ids = torch.tensor([0, 5, 49151, 5])
    assert torch.equal(embed_rows(int4.embed, ids), torch.nn.functional.embedding(ids, fp32.embed))


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_int4_native_gives_the_dequantized_paths_greedy_tokens(engines, prompt):
    """The issue's criterion: the default model loaded natively as int4 (Q4_1) gives the same tokens as the
    dequantized fp32 path for 64 greedy tokens. The weights are the same numbers, but the CPU int4 kernel rounds
    its activations to bf16, so the two runs' logits differ by a little (measured 0.4-0.5% of their range) and, where
    the fp32 run's two best tokens are nearly tied, greedy may take the other one: an equally valid choice, after
    which the outputs part. So: identical for 64 tokens, or parting only where the fp32 run's margin between the two
    choices is within the two runs' measured logit difference there, and that difference stays small (both checked
    teacher-forced on the shared prefix): a wrong kernel shows a large difference and fails."""
    from engine.runner import Work

    tok = engines["fp32"].tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    ref = engines["fp32"].engine.generate(ids, params)
    got = engines["int4"].engine.generate(ids, params)
    if got == ref:
        return
    n = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)

    def last_logits(name):  # the prefix as a prompt, then the step that chose token n as a decode step
        runner = engines[name].engine.runner
        pages = runner.pool.allocate(runner.pool.pages_for(len(ids) + n + 1))
        try:
            runner.run([Work(ids + ref[:n - 1], 0, pages)])
            return runner.run([Work(ref[n - 1:n], len(ids) + n - 1, pages)])[0][-1].float()
        finally:
            runner.pool.deallocate(pages)

    assert n > 0, "int4 departs from fp32 at the first token"
    exact, low = last_logits("fp32"), last_logits("int4")
    diff = float((low - exact).abs().max())
    spread = float(exact.max() - exact.min())
    margin = float(exact[ref[n]] - exact[got[n]])
    assert diff < 0.02 * spread, (
        f"int4 logits differ from fp32 by {diff:.4f} at token {n} ({diff / spread:.2%} of their range): more than "
        "the bf16 rounding of activations explains")
    assert margin <= diff, (
        f"int4 departs from fp32 at token {n} where fp32's margin {margin:.4f} exceeds the logits' difference "
        f"{diff:.4f}: {tok.decode(ref)!r} vs {tok.decode(got)!r}")


@pytest.mark.parametrize("fmt", ["int8", "int4", "ternary"])
def test_quantize_at_load_matches_its_dequantized_twin(tmp_path, fmt):
    """A tiny random HF model quantized at load computes what the same quantized weights, dequantized into a dense
    fp32 model, compute: the low-bit matmul path is only allowed the bf16 rounding of activations the CPU kernels
    use (measured about 0.3-0.6%; bound 2%). Quantization error itself is the kernels' tests' business."""
    from dataclasses import replace

    from engine.model.linear import convert
    _, folder = tiny_hf_model("llama", tmp_path)
    _, weights = load_weights(folder)
    cpu = torch.device("cpu")
    twin_tensors = {n: dequantize(q, torch.float32) if isinstance(q := convert(n, t, fmt, torch.float32, cpu),
                                                                   QuantizedWeight) else t
                    for n, t in weights.tensors.items()}
    ids = torch.randint(0, 300, (40,)).tolist()

    def logits(w, fmt_):
        model = LlamaModel(w, torch.float32, cpu, fmt_)
        runner = ModelRunner(model, 4, torch.float32)
        return runner.run([Work(ids, 0, runner.pool.allocate(1), "all")])[0]
    assert isinstance(LlamaModel(weights, torch.float32, cpu, fmt).layers[0].qkv.weight, QuantizedWeight)
    got = logits(weights, fmt)
    twin = logits(replace(weights, tensors=twin_tensors), "")
    err = ((got - twin).norm() / twin.norm()).item()
    assert err < 0.02, err
