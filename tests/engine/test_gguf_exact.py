"""No silent precision loss: every GGUF type a linear weight can have is stored, with native weights, in a format that
holds what the file holds. Oracle: the gguf package's own dequantization of the same bytes; ours must equal it bit for
bit (every format here is exact; scales are kept in float32 where float16 would round them). Also: mixed formats
stack into one fused weight exactly, the load log and storage summary say what each type became, and the CPU
output layer gives float32-accurate logits."""
import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants

from engine.model.gguf_exact import EXACT_LAYOUTS, pack_exact, probe_planes
from engine.model.linear import fuse
from engine.model.llama import LlamaModel
from engine.model.loader import load_weights
from engine.model.weights import LoadedWeights
from kernels.quant import QuantizedWeight, as_int8, dequantize, quantize
from tests.engine.helpers import tiny_hf_model, write_tiny_gguf

# the fp16 fields of each block (d, and dmin where the type has one): set to random scales of every magnitude
SCALE_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
WRITABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a type the gguf package decodes but cannot write: random codes and sub-scales, fp16 scales
    from 1e-4 to 1 with random signs (and some zero)."""
    rng = np.random.default_rng(seed)
    block, nbytes = GGML_QUANT_SIZES[T[kind]]
    blocks = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[kind]:
        d = (10.0 ** rng.uniform(-4, 0, blocks.shape[:2]) * rng.choice([-1, 1, 0], blocks.shape[:2], p=[.3, .6, .1]))
        blocks[..., offset:offset + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(EXACT_LAYOUTS))
def test_every_decode_only_type_is_stored_bit_exactly(kind):
    """K-quants and IQ4 (the gguf package decodes them but cannot write them): random blocks, 3 seeds."""
    for seed in range(3):
        blocks = random_blocks(kind, 32, 512, seed)
        values = torch.from_numpy(quants.dequantize(blocks, T[kind]).copy())
        scale, minimum = probe_planes(blocks, kind)
        qw = pack_exact(values, torch.from_numpy(scale), None if minimum is None else torch.from_numpy(minimum), kind)
        layout = EXACT_LAYOUTS[kind]
        assert isinstance(qw, QuantizedWeight) and qw.format == layout.fmt and qw.group_size == layout.group
        assert torch.equal(dequantize(qw), values)
    # a tensor whose values no format reproduces is refused (it then stays dense): one value moved off its grid
    values[0, 0] += 1e-3
    assert pack_exact(values, torch.from_numpy(scale), None if minimum is None else torch.from_numpy(minimum),
                      kind) is None


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    hf, _ = tiny_hf_model("llama", tmp_path_factory.mktemp("exact"), seed=5, hidden_size=256, intermediate_size=512)
    return hf


def _encode(x: np.ndarray, kind: str):
    if kind == "F32":
        return x
    data = quants.quantize(x, T[kind])
    return np.ascontiguousarray(data).view(np.uint8), T[kind]


@pytest.mark.parametrize("kind", WRITABLE)
def test_every_writable_type_loads_with_at_least_its_bits(kind, hf_model, tmp_path, caplog):
    """Every GGUF type the gguf package writes, as every linear weight of a tiny Llama: loaded with native weights,
    each weight dequantizes to exactly the gguf package's decoding of the file, in a format of at least the type's
    bits; the storage summary and the load log say what the type became."""
    sd = hf_model.state_dict()
    overrides, decoded = {}, {}
    for i in range(hf_model.config.num_hidden_layers):
        for part, name in (("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
                           ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            x = sd[f"model.layers.{i}.{name}.weight"].numpy()
            overrides[f"blk.{i}.{part}.weight"] = _encode(x, kind)
            decoded[f"model.layers.{i}.{name}.weight"] = x if kind == "F32" else \
                quants.dequantize(overrides[f"blk.{i}.{part}.weight"][0], T[kind])
    path = write_tiny_gguf(hf_model, tmp_path / f"{kind}.gguf", overrides=overrides)
    with caplog.at_level(logging.INFO, logger="ninfer.model"):
        _, weights = load_weights(path, native=True)
    file_bits = 8 * GGML_QUANT_SIZES[T[kind]][1] / GGML_QUANT_SIZES[T[kind]][0]
    for name, want in decoded.items():
        t = weights.tensors[name]
        ours = dequantize(t) if isinstance(t, QuantizedWeight) else t
        assert torch.equal(ours, torch.from_numpy(np.asarray(want, dtype=np.float32))), name
        bits = 8 * t.nbytes / (t.out_features * t.in_features) if isinstance(t, QuantizedWeight) \
            else 8 * t.element_size()
        assert bits >= file_bits, (name, weights.storage[name], bits, file_bits)  # scales included on both sides
    if kind not in ("F32", "F16", "BF16"):
        stored = weights.storage["model.layers.0.mlp.down_proj.weight"]
        assert f"8 x {stored}" in weights.storage_summary()
        assert f"8 x {stored}" in " ".join(r.getMessage() for r in caplog.records)
    expected = {"Q4_0": "int4", "Q4_1": "int4", "Q5_0": "int8", "Q5_1": "int8", "Q8_0": "int8", "TQ1_0": "ternary",
                "TQ2_0": "ternary", "MXFP4": "float32"}.get(kind)
    if expected:
        assert weights.storage["model.layers.0.mlp.down_proj.weight"] == f"{kind} -> {expected}"


def test_mixed_formats_fuse_exactly():
    """q/k/v of different formats (a Q4_K_M file: Q4_K q/k, Q6_K v) stack as int8 with mins, holding each exactly;
    as_int8 is exact for every format."""
    parts = [quantize(torch.randn(64, 256), "int4_asym", 32), quantize(torch.randn(32, 256), "int4_sym", 64),
             quantize(torch.randn(32, 256), "int8", 16), quantize(torch.randn(16, 256), "ternary", 64),
             quantize(torch.randn(16, 256), "int8")]
    for p in parts:
        assert torch.equal(dequantize(as_int8(p, 16)), dequantize(p))
    fused = fuse(parts)
    assert fused.format == "int8" and fused.group_size == 16
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
    # symmetric parts with float16 scales (a Q4_0 q/k beside a Q8_0 v): int8 without mins, float16 scales, exact
    half = lambda q: QuantizedWeight(q.format, q.qweight, q.scales.half(), None, q.group_size, q.shape)  # noqa: E731
    sym = [half(quantize(torch.randn(64, 256), "int4_sym", 32)), half(quantize(torch.randn(16, 256), "int8", 32))]
    fused = fuse(sym)
    assert (fused.format, fused.group_size, fused.mins, fused.scales.dtype) == ("int8", 32, None, torch.float16)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in sym]))
    assert fused.nbytes < sum(as_int8(p, 32).nbytes for p in sym)
    # one format whose scales differ in dtype (Q4_1's float16 beside Q4_K's float32): stays int4, float32 scales
    a, b = quantize(torch.randn(32, 64), "int4_asym", 32), quantize(torch.randn(16, 64), "int4_asym", 32)
    b = QuantizedWeight(b.format, b.qweight, b.scales.float(), b.mins.float(), 32, b.shape)
    fused = fuse([a, b])
    assert fused.format == "int4_asym" and fused.scales.dtype == torch.float32
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))


def test_mixed_k_quant_model_runs_its_exact_weights_and_fp32_logits(hf_model, tmp_path):
    """A tiny Llama stored like a Q4_K_M file (attention Q4_K with Q6_K v, gate/up Q5_0, down Q6_K, Q8_0
    embedding tied to the output): every layer is kept exactly, and on the CPU the output layer is the float32
    decoding of the Q8_0 embedding, so the logits are float32 products of the final hidden state (not rounded
    to bf16) and equal an fp32 reference within 1e-5."""
    sd = hf_model.state_dict()
    overrides = {}
    for i in range(hf_model.config.num_hidden_layers):
        for j, (part, kind) in enumerate((("attn_q", "Q4_K"), ("attn_k", "Q4_K"), ("attn_v", "Q6_K"),
                                          ("attn_output", "Q4_K"), ("ffn_down", "Q6_K"))):
            rows, cols = sd[f"model.layers.{i}.{_hf(part)}.weight"].shape
            overrides[f"blk.{i}.{part}.weight"] = (random_blocks(kind, rows, cols, seed=10 * i + j), T[kind])
        for part in ("ffn_gate", "ffn_up"):
            overrides[f"blk.{i}.{part}.weight"] = _encode(sd[f"model.layers.{i}.{_hf(part)}.weight"].numpy(), "Q5_0")
    overrides["token_embd.weight"] = _encode(sd["model.embed_tokens.weight"].numpy(), "Q8_0")
    path = write_tiny_gguf(hf_model, tmp_path / "q4km.gguf", overrides=overrides, skip=("output.weight",))
    _, native = load_weights(path, native=True)
    _, dense = load_weights(path)  # every tensor decoded to float32 by the gguf package: the oracle
    ours = LlamaModel(native, torch.float32, torch.device("cpu"), "int4", keep_native=True)
    layer = ours.layers[0]
    assert layer.qkv.weight.format == "int8" and layer.qkv.weight.group_size == 16  # Q4_K q/k + Q6_K v, exact
    assert layer.gate_up.weight.format == "int8" and layer.gate_up.weight.group_size == 32  # Q5_0: not int4
    oracle = LlamaModel(LoadedWeights(dense.config, dict(dense.tensors), "gguf"), torch.float32, torch.device("cpu"))
    for name in ("qkv", "gate_up", "o", "down"):
        ours_w, oracle_w = getattr(layer, name).weight, getattr(oracle.layers[0], name).weight
        assert torch.equal(dequantize(ours_w), oracle_w), name
    head = ours.lm_head.weight
    assert isinstance(head, torch.Tensor) and head.dtype == torch.float32
    assert torch.equal(head, dense.tensors["model.embed_tokens.weight"])
    seen = []

    class Recording:  # the output layer, recording its input (the final hidden state)
        def __init__(self, linear):
            self.linear, self.weight, self.nbytes = linear, linear.weight, linear.nbytes

        def __call__(self, x):
            seen.append(x.clone())
            return self.linear(x)
    ours.lm_head = Recording(ours.lm_head)
    from engine.memory.kv.table import PageList
    from engine.runner import Work
    from tests.engine.helpers import make_runner
    logits = make_runner(ours).run([Work(list(range(3, 40)), 0, PageList(range(4)), "all")])[0]
    reference = seen[-1].double() @ head.double().T
    assert logits.dtype == torch.float32
    assert ((logits.double() - reference).abs().max() / reference.abs().max()).item() < 1e-5
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9  # not bf16-rounded


def _hf(part: str) -> str:
    return {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}[part]
