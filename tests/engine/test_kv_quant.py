"""Quantized paged KV (engine/memory/kv/quant.py, engine/memory/kv/cache.py): round-trip bounds, the Hadamard rotation, bytes per
token against the ledger, attention error on keys with outlier channels, and end to end on tiny random models and on
the embedded SmolLM2. The measured numbers are in the comments and in docs/KV.md (run with -s to see the tables)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.memory.kv import quant
from engine.memory.kv.cache import KVCache
from engine.memory.kv.quant import QUANT_KV_DTYPES, kv_format
from engine.memory.geometry import KV_LAYOUTS, PAGE_SIZE
from engine.batch import ForwardBatch, SeqSlice
from engine.model.layers import paged_attention
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams
from tests.engine.helpers import make_engine, our_model, random_prompt, rel_err, runner_logits

ALL = ["fp32", "fp16", "bf16", "k8v8", "k8v4", "k4v4", "rk4v4"]
CPU = torch.device("cpu")


def kv_arg(name: str):
    """What the runner takes: a torch dtype for fp32 (as build_engine passes it), the name otherwise."""
    return torch.float32 if name == "fp32" else name


def rough_data(shape, seed: int) -> torch.Tensor:
    """Gaussian values whose magnitude varies from 1e-3 to 1e3 from row to row, with exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10 ** (6 * torch.rand(shape[:-1], generator=g) - 3).unsqueeze(-1)
    x[0] = 0  # an all-zero head must give zero scale codes, not NaN
    x[1, ..., :5] = 0
    return x


# ---------------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80, 16])
def test_round_trip_error_is_at_most_half_a_scale(bits, head_dim):
    x = rough_data((200, 3, head_dim), seed=bits * 1000 + head_dim)
    codes, s = quant.quantize(x, bits)
    g = quant.group_size(bits, head_dim)
    assert g == (head_dim if bits == 8 else {64: 32, 128: 32, 256: 32, 80: 20, 16: 16}[head_dim])
    assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert codes.shape == (200, 3, head_dim if bits == 8 else head_dim // 2)
    assert s.dtype == torch.float16 and s.shape == (200, 3, head_dim // g)
    y = quant.dequantize(codes, s, bits)
    bound = s.float().repeat_interleave(g, -1) / 2
    err = (y - x).abs()
    assert bool((err <= bound * (1 + 1e-6)).all()), f"worst error / scale = {(err / (2 * bound)).max():.4f}"
    # the scale is tight: the group's absmax maps to 127 (int8) or 7.5 (int4), within fp16 rounding up
    amax = x.unflatten(-1, (-1, g)).abs().amax(-1)
    top = 127.0 if bits == 8 else 7.5
    big = amax / top > 2.0 ** -14 * 1.01  # not clamped up to the smallest normal fp16 scale
    ratio = (amax / s.float())[big]
    assert bool((ratio <= top).all()) and bool((ratio >= top * (1 - 2e-3)).all())
    assert bool((y[0] == 0).all()) and bool((y[1, ..., :5] == 0).all())
    if bits == 4:  # q = code - 8: +-absmax round to +-7, so codes 1..15 are in use (0 = -8 decodes but never occurs)
        unpacked = torch.stack((codes & 15, codes >> 4), -1).flatten(-2)
        assert set(unpacked.unique().tolist()) == set(range(1, 16))
    else:
        assert int(codes.min()) >= -127 and int(codes.max()) == 127


def test_scales_saturate_at_the_fp16_limits():
    """Beyond fp16's range the scale saturates at 65504 and values clip (|x| > 65504 x 127 or x 7.5: far outside
    real K/V); tiny groups get the smallest normal scale 2^-14, so their error stays below 2^-15."""
    x = torch.tensor([[1e8] + [0.0] * 31, [1e-7] + [0.0] * 31])
    for bits, top in ((8, 127), (4, 7)):
        codes, s = quant.quantize(x, bits)
        assert s.float()[:, 0].tolist() == [65504.0, 2.0 ** -14]
        y = quant.dequantize(codes, s, bits)
        assert y[0, 0].item() == top * 65504 and abs(y[1, 0].item() - 1e-7) <= 2.0 ** -15


def test_int4_packing_is_low_nibble_first():
    x = torch.tensor([[7.5, -7.5, 1.0, -3.0] + [0.0] * 28])  # scale 1 (rounded up to 1.000977): q = 7, -7, 1, -3
    codes, s = quant.quantize(x, 4)
    assert float(s[0, 0]) == 1 + 2 ** -10
    assert codes[0, :2].tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | ((-3 + 8) << 4)]
    assert quant.dequantize(codes, s, 4)[0, :4].tolist() == pytest.approx([7 * 1.000977, -7 * 1.000977, 1.000977,
                                                                            -3 * 1.000977], rel=1e-6)
    # code 0 decodes to -8 scales (the clamp allows it; the quantizer never emits it)
    assert quant.dequantize(torch.zeros(1, 16, dtype=torch.uint8), s, 4)[0, 0].item() == -8 * (1 + 2 ** -10)


@pytest.mark.parametrize("head_dim, block", [(64, 64), (128, 128), (256, 256), (80, 16), (96, 32), (48, 16)])
def test_hadamard_is_orthonormal_symmetric_and_preserves_dot_products(head_dim, block):
    assert quant.hadamard_block(head_dim) == block
    h = quant.hadamard(head_dim)
    eye = torch.eye(head_dim)
    assert torch.allclose(h @ h.T, eye, atol=1e-6) and torch.equal(h, h.T)
    assert bool((h[:block, :block].abs() - block ** -0.5).abs().max() < 1e-7)  # every entry +-1/sqrt(block)
    g = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(50, head_dim, generator=g), torch.randn(70, head_dim, generator=g)
    k[:, 3] *= 20  # an outlier channel ...
    assert torch.allclose(quant.rotate(q) @ quant.rotate(k).T, q @ k.T, rtol=1e-5, atol=1e-3)
    assert torch.allclose(quant.rotate(quant.rotate(k)), k, atol=1e-4)
    # ... is spread over its whole block: no rotated channel keeps a large share of the energy
    share = (quant.rotate(k) ** 2).mean(0) / (quant.rotate(k) ** 2).mean(0).sum()
    assert float(share.max()) < 4 / block


def test_kv_format_names():
    assert kv_format(torch.bfloat16).name == "bf16" and not kv_format("fp16").quantized
    f = kv_format("rk4v4")
    assert (f.k.bits, f.v.bits, f.k.rotate, f.v.rotate) == (4, 4, True, False)
    assert (kv_format("k8v4").k.bits, kv_format("k8v4").v.bits) == (8, 4)
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        kv_format("k2v2")


# ---------------------------------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("name", ALL)
def test_cache_write_gather_round_trip_on_scattered_pages(name):
    H, D = 2, 64
    cache = KVCache(2, 6, H, D, kv_arg(name), CPU)
    k, v = rough_data((150, H, D), 1), rough_data((150, H, D), 2)
    pages = [4, 1, 3]  # out of order; 150 tokens end inside the third page
    slots = torch.tensor([pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(150)])
    cache.write(1, slots, k, v)
    gk, gv = cache.gather(1, torch.tensor(pages), 150, torch.float32)
    assert gk.shape == gv.shape == (150, H, D) and gk.dtype == torch.float32
    fmt = kv_format(name)
    want_k = quant.rotate(k) if fmt.k.rotate else k
    for got, want, part in ((gk, want_k, fmt.k), (gv, v, fmt.v)):
        if part.quantized:  # exactly dequantize(quantize(x))
            assert torch.equal(got, quant.dequantize(*quant.quantize(want, part.bits), part.bits))
        else:
            assert torch.equal(got, want.to(part.dtype).float())
    # one page, and a prefix of the context
    gk1, _ = cache.gather(1, torch.tensor([4]), 10, torch.float32)
    assert torch.equal(gk1, gk[:10])
    # layer 0 was never written
    assert bool((cache.gather(0, torch.tensor(pages), 150, torch.float32)[0] == 0).all())
    # whole pages copy with their scales
    cache.copy_pages([4, 1], [0, 2])
    assert torch.equal(cache.gather(1, torch.tensor([0, 2]), 128, torch.float32)[1], gv[:128])


def test_rotated_queries_against_rotated_keys_give_the_same_scores():
    cache = KVCache(1, 2, 2, 64, "rk4v4", CPU)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 4, 64, generator=g)
    k, v = torch.randn(64, 2, 64, generator=g), torch.randn(64, 2, 64, generator=g)
    exact = KVCache(1, 2, 2, 64, torch.float32, CPU)
    assert exact.rotate_queries(q) is q
    cache.write(0, torch.arange(64), k, v)
    gk, _ = cache.gather(0, torch.tensor([0]), 64, torch.float32)
    # rotated-basis scores equal the plain ones up to the int4 error of K (no basis mismatch)
    plain = torch.einsum("qhd,khd->hqk", q[:, ::2], k)
    rotated = torch.einsum("qhd,khd->hqk", cache.rotate_queries(q)[:, ::2], gk)
    assert rel_err(rotated, plain) < 0.15


SMOL = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head_dim
QWEN = (16, 4, 256)  # Qwen3.5-27B-like: its 16 full-attention layers x 4 KV heads x 256
# Measured (bytes per token, x bf16):
#   SmolLM2-135M: fp32 46,080 (2.00) fp16/bf16 23,040 (1.00) k8v8 11,880 (0.516) k8v4 9,180 (0.398)
#                 k4v4/rk4v4 6,480 (0.281)
#   Qwen3.5-27B-like: fp32 131,072 (2.00) bf16 65,536 (1.00) k8v8 33,024 (0.504) k8v4 25,728 (0.393)
#                 k4v4/rk4v4 18,432 (0.281) -> a 64-token page is 1.125 MiB for rk4v4, 1.57 MiB for k8v4
WANT = {"SmolLM2-135M": {"fp32": 46080, "fp16": 23040, "bf16": 23040, "k8v8": 11880, "k8v4": 9180, "k4v4": 6480,
                         "rk4v4": 6480},
        "Qwen3.5-27B-like": {"fp32": 131072, "fp16": 65536, "bf16": 65536, "k8v8": 33024, "k8v4": 25728,
                             "k4v4": 18432, "rk4v4": 18432}}


def test_bytes_per_token_table_and_the_ledger():
    print("\nKV bytes per token (x bf16)")
    for label, shape in (("SmolLM2-135M", SMOL), ("Qwen3.5-27B-like", QWEN)):
        bf16 = KV_LAYOUTS["bf16"].bytes_per_token(*shape)
        row = {name: KV_LAYOUTS[name].bytes_per_token(*shape) for name in ALL}
        print(f"  {label:17}" + "  ".join(f"{n} {b:,} ({b / bf16:.3f})" for n, b in row.items()))
        assert row == WANT[label]
        assert row["k8v4"] <= 0.4 * bf16  # the requirement
        assert row["fp32"] > row["bf16"] > row["k8v8"] > row["k8v4"] > row["k4v4"] == row["rk4v4"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [SMOL[1:], QWEN[1:], (2, 16), (8, 128), (2, 80)])
def test_page_bytes_from_the_tensors_agree_with_the_geometry(name, shape):
    """The tensors the KV cache allocates hold exactly the bytes engine.memory.geometry states for the dtype."""
    heads, head_dim = shape
    cache = KVCache(3, 2, heads, head_dim, kv_arg(name), CPU)
    per_token = KV_LAYOUTS[name].bytes_per_token(3, heads, head_dim)
    assert cache.page_bytes == per_token * PAGE_SIZE and cache.token_bytes == per_token


# ---------------------------------------------------------------------------------------------------- attention error
def outlier_data(outliers: bool, T: int = 512, H: int = 4, Hq: int = 12, D: int = 64, seed: int = 0):
    """q, k, v like one layer's post-RoPE activations. With `outliers`, 4 of the 64 key channels of every head are
    20x larger (as in real LLM keys; the same channels for every token), and q is scaled down so that the scores
    keep a softmax-friendly spread (std ~1.3 instead of ~5)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    q = torch.randn(T, Hq, D, generator=g)
    if outliers:
        k[..., torch.randperm(D, generator=g)[:4]] *= 20
        q *= 0.25
    return q, k, v


def attention_errors(name: str, outliers: bool) -> tuple[float, float]:
    """(relative error of the causal attention output, of the scores) of paged_attention over a `name` cache vs
    plain fp32, both in the Frobenius norm."""
    q, k, v = outlier_data(outliers)
    T, H, D = k.shape
    pages = torch.tensor([3, 0, 5, 1, 7, 2, 6, 4])

    def run(kv_dtype):
        cache = KVCache(1, 8, H, D, kv_arg(kv_dtype), CPU)
        slots = torch.tensor([int(pages[t // PAGE_SIZE]) * PAGE_SIZE + t % PAGE_SIZE for t in range(T)])
        batch = ForwardBatch(torch.zeros(T, dtype=torch.long), torch.arange(T), slots, [SeqSlice(0, T, T, pages)],
                             cache)
        out = paged_attention(q, k, v, 0, batch, D ** -0.5)
        keys, _ = cache.gather(0, pages, T, torch.float32)
        scores = torch.einsum("thd,shd->hts", cache.rotate_queries(q)[:, ::3], keys)  # q head 3h reads kv head h
        return out, scores

    ref_out, ref_scores = run("fp32")
    out, scores = run(name)
    return (float((out - ref_out).norm() / ref_out.norm()), float((scores - ref_scores).norm() / ref_scores.norm()))


def test_attention_error_ordering_and_the_rotation_gain():
    """Measured (relative Frobenius error of the output / of the scores), 512 tokens, 12 q heads over 4 kv heads, D 64:
                 plain random K            K with 4 channels x20
       fp16      0.0003 / 0.0002           0.0005 / 0.0002
       bf16      0.0022 / 0.0017           0.0035 / 0.0017
       k8v8      0.0079 / 0.0059           0.0200 / 0.0140
       k8v4      0.0948 / 0.0059           0.0953 / 0.0140
       k4v4      0.1249 / 0.0946           0.1987 / 0.1546
       rk4v4     0.1237 / 0.0944           0.1363 / 0.0754    <- rotation: scores 2.0x better, output 1.5x
    The output error of the v4 formats is dominated by V's 4-bit error (~9%), which the rotation does not touch."""
    err = {(n, o): attention_errors(n, o) for n in ALL[1:] for o in (False, True)}
    print("\nattention error vs fp32 (output / scores)")
    for n in ALL[1:]:
        print(f"  {n:6} plain {err[n, False][0]:.4f} / {err[n, False][1]:.4f}   "
              f"outliers {err[n, True][0]:.4f} / {err[n, True][1]:.4f}")
    for o in (False, True):
        out = {n: err[n, o][0] for n in ALL[1:]}
        assert out["fp16"] < out["bf16"] < out["k8v8"] < out["k8v4"] < out["k4v4"]
        assert out["fp16"] < 1e-3 and out["k8v8"] < 0.03 and out["k8v4"] < 0.12 and out["k4v4"] < 0.2
        assert err["k8v4", o][1] == err["k8v8", o][1]  # same keys
    # outliers hurt unrotated int4 keys; the rotation wins the error back by a clear margin
    assert err["rk4v4", True][1] < 0.6 * err["k4v4", True][1]
    assert err["rk4v4", True][0] < 0.8 * err["k4v4", True][0]
    # and on keys without outliers it is neither better nor worse
    assert abs(err["rk4v4", False][1] / err["k4v4", False][1] - 1) < 0.1


def test_decode_step_after_prefill_reads_the_quantized_context():
    """A one-token decode step over the pages a prefill wrote equals attention over dequantized K/V."""
    q, k, v = outlier_data(True, T=100)
    H, D = k.shape[1:]
    pages = torch.tensor([1, 0])
    for name in QUANT_KV_DTYPES:
        cache = KVCache(1, 2, H, D, name, CPU)
        prefill = ForwardBatch(torch.zeros(99, dtype=torch.long), torch.arange(99), torch.arange(64, 163) % 128,
                               [SeqSlice(0, 99, 99, pages)], cache)
        paged_attention(q[:99], k[:99], v[:99], 0, prefill, D ** -0.5)
        step = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.tensor([99]), torch.tensor([35]),
                            [SeqSlice(0, 1, 100, pages)], cache)
        out = paged_attention(q[99:], k[99:], v[99:], 0, step, D ** -0.5)
        fmt = kv_format(name)
        kd = quant.dequantize(*quant.quantize(quant.rotate(k) if fmt.k.rotate else k, fmt.k.bits), fmt.k.bits)
        vd = quant.dequantize(*quant.quantize(v, fmt.v.bits), fmt.v.bits)
        qd = quant.rotate(q[99:]) if fmt.k.rotate else q[99:]
        ref = torch.nn.functional.scaled_dot_product_attention(qd.transpose(0, 1), kd.transpose(0, 1),
                                                               vd.transpose(0, 1), scale=D ** -0.5, enable_gqa=True)
        assert rel_err(out, ref.transpose(0, 1)) < 1e-5, name


# ---------------------------------------------------------------------------------------------------- tiny models
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", ["llama", "qwen3"])  # head_dim 16 and 32 (int4 groups of 16 / 32)
def test_tiny_model_logits_and_greedy_per_kv_dtype(tiny_models, variant):
    """Measured (the fixture's models; relative max error of 150 teacher-forced logits vs fp32, greedy prefix of 32):
       llama: fp16 5.7e-4 (32) bf16 3.9e-3 (32) k8v8 0.011 (32) k8v4 0.14 (8) k4v4 0.20 (11) rk4v4 0.17 (11)
       qwen3: fp16 5.2e-4 (32) bf16 3.9e-3 (32) k8v8 0.012 (14) k8v4 0.14 (2) k4v4 0.18 (2) rk4v4 0.19 (2)
    Random tiny models have near-flat logits, so greedy runs part early at small errors; the real model is tested
    below."""
    _, folder = tiny_models(variant)
    model = our_model(folder)
    prompt = random_prompt(np.random.default_rng(7), 512, 150)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    logits, tokens = {}, {}
    for name in ALL:
        runner = ModelRunner(model, 8, kv_arg(name), PAGE_SIZE)
        logits[name] = runner_logits(runner, prompt)
        # chunked prefill reads the same quantized pages as one shot does
        assert rel_err(runner_logits(runner, prompt, chunks=[37, 64]), logits[name]) < 1e-4
        engine = make_engine(runner, max_concurrency=1)
        try:
            tokens[name] = engine.generate(prompt[:20], greedy)
        finally:
            engine.shutdown()
        assert runner.pool.num_free == 8
    err = {n: rel_err(logits[n], logits["fp32"]) for n in ALL}
    prefix = {n: next((i for i, (a, b) in enumerate(zip(tokens[n], tokens["fp32"])) if a != b), 32) for n in ALL}
    print(f"\n{variant}: " + "  ".join(f"{n} {e:.3g} ({prefix[n]}/32)" for n, e in err.items()))
    assert err["fp16"] < err["bf16"] < err["k8v8"] < err["k8v4"] and err["k8v8"] < err["k4v4"]
    assert err["fp16"] < 2e-3 and err["bf16"] < 1e-2 and err["k8v8"] < 0.03 and max(err.values()) < 0.5
    assert prefix["fp16"] == 32 and prefix["bf16"] >= 8 and prefix["k8v8"] >= 8


# ---------------------------------------------------------------------------------------------------- SmolLM2
FRANCE = "What is the capital of France? Answer in one sentence."


def greedy_ids(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens straight from the runner (no EOS stop: all n tokens are compared)."""
    pages = runner.pool.allocate(-(-(len(prompt) + n) // PAGE_SIZE))
    tokens, out, start = list(prompt), [], 0
    try:
        for _ in range(n):
            logits = runner.run([Work(tokens[start:], start, pages, "last")])[0]
            start = len(tokens)
            out.append(int(logits[-1].argmax()))
            tokens.append(out[-1])
    finally:
        runner.pool.deallocate(pages)
    return out


@pytest.mark.slow
def test_default_model_teacher_forced_and_greedy_per_kv_dtype(default_fp32_engine):
    """SmolLM2-135M-Instruct (Q4_1 GGUF, fp32 compute), 213-token teacher-forced text and 32 greedy tokens of the
    France question vs an fp32 KV. Measured:
       kv     top-1 agree   KL(fp32 || kv)   greedy prefix
       fp16   1.000         2e-7             32/32
       bf16   1.000         1.4e-5           32/32
       k8v8   0.991         4.9e-4           32/32
       k8v4   0.953         0.019            26/32  ("The capital of France is Paris." then diverges later)
       k4v4   0.878         0.095             0/32  ("Le Grand Paris is the capital of France.")
       rk4v4  0.892         0.041             0/32
    k8v4 misses the 97% the brief hoped for on this 135M model: V at 4 bits is what costs (k8v8 is at 99.1%)."""
    from tests.engine.test_default_model import TEXT

    tok = default_fp32_engine.tokenizer
    model = default_fp32_engine.engine.runner.model
    ids = tok.encode(TEXT)
    prompt = tok.apply_chat_template([{"role": "user", "content": FRANCE}])
    logits, greedy = {}, {}
    for name in ALL:
        runner = ModelRunner(model, 8, kv_arg(name), PAGE_SIZE)
        logits[name] = runner_logits(runner, ids)
        greedy[name] = greedy_ids(runner, prompt, 32)
    ref = logits["fp32"]
    agree = {n: (logits[n].argmax(-1) == ref.argmax(-1)).float().mean().item() for n in ALL}
    kl = {n: torch.nn.functional.kl_div(logits[n].log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                        reduction="batchmean").item() for n in ALL}
    prefix = {n: next((i for i, (a, b) in enumerate(zip(greedy[n], greedy["fp32"])) if a != b), 32) for n in ALL}
    print(f"\nSmolLM2, {len(ids)} tokens teacher-forced; greedy 32 of the France question")
    for n in ALL:
        print(f"  {n:6} top-1 {agree[n]:.3f}  KL {kl[n]:.2g}  greedy prefix {prefix[n]}/32  {tok.decode(greedy[n])!r}")
    assert len(ids) >= 200
    assert agree["fp16"] >= 0.99 and agree["bf16"] >= 0.99 and agree["k8v8"] >= 0.97
    assert agree["k8v4"] >= 0.93  # measured 0.953
    assert min(agree["k4v4"], agree["rk4v4"]) >= 0.8
    assert kl["fp16"] < kl["k8v8"] < kl["k8v4"] < kl["k4v4"] and kl["rk4v4"] < kl["k4v4"]
    assert greedy["k8v8"] == greedy["fp32"] == greedy["fp16"]
    assert prefix["k8v4"] >= 16  # measured 26
    assert "Paris" in tok.decode(greedy["k8v4"][:10])


@pytest.mark.slow
def test_build_engine_with_k8v4_answers_paris_and_frees_its_pages(engine_for):

    loaded = engine_for(None, kv_dtype="k8v4", max_concurrency=1, max_context=1024)
    kv = loaded.engine.runner.kv
    assert kv.kv_dtype == "k8v4" and kv.k[0].dtype == torch.int8 and kv.v[0].dtype == torch.uint8
    assert kv.k[0].shape == (16, PAGE_SIZE, 3, 64) and kv.v_scale[0].shape == (16, PAGE_SIZE, 3, 2)
    assert kv.token_bytes == 9180
    loaded.engine.start()
    try:
        tok = loaded.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": FRANCE}])
        out = loaded.engine.generate(prompt, SamplingParams(temperature=0, max_tokens=48))
        answer = tok.decode(out)
        assert "Paris" in answer, answer
        stats = loaded.engine.stats()
        assert stats["pages_total"] == 1024 // PAGE_SIZE and stats["pages_free"] == stats["pages_total"]
        assert stats["finished"] == 1 and stats["decode_tokens"] >= 5
    finally:
        loaded.engine.shutdown()


def test_kv_dtype_auto_and_the_settings():
    from engine.build import pick_kv_dtype
    from engine.config.loading import settings_from_mapping

    assert pick_kv_dtype("auto", CPU) == torch.float32
    assert pick_kv_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert pick_kv_dtype("fp16", CPU) == torch.float16
    for name in QUANT_KV_DTYPES:
        assert pick_kv_dtype(name, CPU) == name
        assert settings_from_mapping({"kv_dtype": name}, "app").kv_dtype == name


# ---------------------------------------------------------------------------------------------------- CPU cost
def bench_kv_dtypes(prompt_tokens: int = 512, gen_tokens: int = 64, repeat: int = 2) -> None:
    """Decode tok/s of SmolLM2 per kv_dtype through engine.tools.bench.measure.bench_engine, one model shared by
    every engine. Run: python -m tests.engine.test_kv_quant   (docs/KV.md has the numbers)."""
    import dataclasses

    from engine.tools.bench.machine import LoadMeter
    from engine.tools.bench.measure import bench_engine, build_prompt
    from engine.build import build_engine
    from engine.engine import Engine

    loaded = build_engine(None, max_concurrency=1, max_context=1024)
    prompt = build_prompt(loaded.tokenizer, prompt_tokens)
    print(f"SmolLM2-135M, {loaded.device}, {torch.get_num_threads()} threads, prompt {prompt_tokens}, "
          f"{gen_tokens} generated, median of {repeat}")
    for name in ALL:
        runner = ModelRunner(loaded.engine.runner.model, 1024 // PAGE_SIZE, kv_arg(name), PAGE_SIZE)
        engine = Engine(runner, max_concurrency=1, prefill_chunk=512, max_context=1024, max_shared_prefixes=0)
        try:
            with LoadMeter() as load:
                r = bench_engine(dataclasses.replace(loaded, engine=engine), prompt, gen_tokens, repeat)
        finally:
            engine.shutdown()
        print(f"  {name:6} decode {r['decode_tps']:6.2f} tok/s  prefill {r['prefill_tps']:7.1f} tok/s  "
              f"(other processes used {load.cores:.1f} cores meanwhile)")


def bench_attention_step(ctx: int = 576, rounds: int = 30, steps: int = 30) -> None:
    """CPU time of one decode step's paged_attention for one SmolLM2 layer (9 q heads over 3 kv heads, D 64) at
    context `ctx`, one thread: write + dequantizing gather + SDPA. Thread CPU time, the minimum over interleaved
    rounds (robust on a busy machine); x 30 layers is the per-token cost."""
    import time

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    H, Hq, D = 3, 9, 64
    pages = torch.arange(-(-ctx // PAGE_SIZE))
    g = torch.Generator().manual_seed(0)
    runs = {}
    for name in ALL:
        cache = KVCache(1, len(pages), H, D, kv_arg(name), CPU)
        cache.write(0, torch.arange(ctx), torch.randn(ctx, H, D, generator=g), torch.randn(ctx, H, D, generator=g))
        batch = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.tensor([ctx - 1]), torch.tensor([ctx - 1]),
                             [SeqSlice(0, 1, ctx, pages)], cache)
        runs[name] = ((torch.randn(1, Hq, D), torch.randn(1, H, D), torch.randn(1, H, D), batch), [])
    for _ in range(rounds):
        for (args, times) in runs.values():
            t0 = time.thread_time()
            for _ in range(steps):
                paged_attention(*args[:3], 0, args[3], D ** -0.5)
            times.append((time.thread_time() - t0) / steps)
    torch.set_num_threads(before)
    base = min(runs["fp32"][1])
    print(f"paged_attention decode step, one SmolLM2 layer, context {ctx}, 1 thread, CPU time (min of {rounds})")
    for name, (_, times) in runs.items():
        t = min(times)
        print(f"  {name:6} {t * 1e6:6.0f} us  (+{(t - base) * 1e6:4.0f} us vs fp32; x30 layers "
              f"+{(t - base) * 30 * 1e3:5.2f} ms per token)")


if __name__ == "__main__":  # python -m tests.engine.test_kv_quant
    bench_attention_step()
    bench_kv_dtypes()
