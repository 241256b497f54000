"""GGUF types the kernels do not run as stored (K-quants, TQ1_0, Q5_*) load, with native weights, in the nearest
format they do run: decoded by the gguf package, then int4 (groups of 32), ternary or int8 per channel; the load log
says so. Checked against the gguf package's own decoding of the same file."""
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from engine.model.gguf_file import nearest_native
from engine.model.linear import native_format
from engine.model.llama import LlamaModel
from engine.model.loader import load_weights
from engine.model.weights import LoadedWeights
from kernels.quant import QuantizedWeight, dequantize
from tests.engine.helpers import tiny_hf_model, write_tiny_gguf

BLOCK_BYTES = {T.Q4_K: 144, T.Q6_K: 210}


def random_blocks(qtype, rows: int, cols: int, seed: int = 0, d: float = 0.01) -> np.ndarray:
    """Random K-quant blocks (the gguf package decodes them but cannot make them) with small fp16 scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scale = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if qtype == T.Q4_K:  # d and dmin lead the block
        blocks[..., 0:2], blocks[..., 2:4] = scale, scale
    else:  # Q6_K: d ends it
        blocks[..., -2:] = scale
    return blocks.reshape(rows, -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_nearest_formats_against_the_gguf_decoding():
    q4k = torch.from_numpy(quants.dequantize(random_blocks(T.Q4_K, 32, 512), T.Q4_K).copy())
    w = nearest_native(q4k, "Q4_K")
    assert isinstance(w, QuantizedWeight) and w.format == "int4_asym" and w.group_size == 32
    # a Q4_K sub-block is 32 values on a 16-level grid: where its codes span 0..15 int4 g32 holds it exactly (up to
    # fp16 scales); measured 1.5% overall on random blocks, against ~9% for int4 of Gaussian weights
    assert rel(dequantize(w), q4k) < 3e-2
    q6k = torch.from_numpy(quants.dequantize(random_blocks(T.Q6_K, 32, 512), T.Q6_K).copy())
    w = nearest_native(q6k, "Q6_K")
    assert w.format == "int8" and w.group_size == 512 and rel(dequantize(w), q6k) < 1e-2
    x = np.random.default_rng(1).standard_normal((32, 512)).astype(np.float32)
    tq1 = torch.from_numpy(quants.dequantize(quants.quantize(x, T.TQ1_0), T.TQ1_0).copy())
    w = nearest_native(tq1, "TQ1_0")
    assert w.format == "ternary" and torch.equal(dequantize(w).half(), tq1.half())  # exact (fp16 scales)
    assert nearest_native(torch.zeros(8, 96), "Q4_K") is not None  # groups of 32 fit
    assert nearest_native(torch.zeros(8, 40), "Q4_K") is None and nearest_native(torch.zeros(8, 96), "TQ1_0") is None


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny Llama (hidden 256) stored like a Q4_K_M file: attention Q4_K, gate/up TQ1_0, down Q6_K."""
    tmp = tmp_path_factory.mktemp("nearest")
    hf, _ = tiny_hf_model("llama", tmp, seed=3, hidden_size=256, intermediate_size=512)
    overrides = {}
    for i in range(hf.config.num_hidden_layers):
        sd = hf.state_dict()
        for part, hf_name in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                              ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj")):
            rows, cols = sd[f"model.layers.{i}.{hf_name}.weight"].shape
            overrides[f"blk.{i}.{part}.weight"] = (random_blocks(T.Q4_K, rows, cols, seed=i), T.Q4_K)
        for part, hf_name in (("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj")):
            x = sd[f"model.layers.{i}.{hf_name}.weight"].numpy()
            overrides[f"blk.{i}.{part}.weight"] = (quants.quantize(x, T.TQ1_0), T.TQ1_0)
        rows, cols = sd[f"model.layers.{i}.mlp.down_proj.weight"].shape
        overrides[f"blk.{i}.ffn_down.weight"] = (random_blocks(T.Q6_K, rows, cols, seed=10 + i), T.Q6_K)
    return write_tiny_gguf(hf, tmp / "mixed.gguf", overrides=overrides)


def test_a_k_quant_file_runs_low_bit_and_matches_its_decoding(mixed_gguf, caplog):
    with caplog.at_level(logging.INFO, logger="ninfer.model"):
        _, native = load_weights(mixed_gguf, native=True)
    log = " ".join(r.getMessage() for r in caplog.records)
    for kind, fmt in (("Q4_K", "int4"), ("TQ1_0", "ternary"), ("Q6_K", "int8")):
        assert f"{kind} tensors decoded by the gguf package and stored as {fmt}" in log
    assert "8 x Q4_K as int4" in native.storage_summary() and "2 x Q6_K as int8" in native.storage_summary()
    _, dense = load_weights(mixed_gguf)  # every tensor decoded to float32 by the gguf package
    assert native_format(native.tensors) == "int4"
    ours = LlamaModel(native, torch.float32, torch.device("cpu"), "int4", keep_native=True)
    layer = ours.layers[0]
    assert layer.qkv.weight.format == "int4_asym" and layer.gate_up.weight.format == "ternary"
    assert layer.down.weight.format == "int8"  # kept (not requantized to the majority's int4)
    oracle = LlamaModel(LoadedWeights(dense.config, dict(dense.tensors), "gguf"), torch.float32, torch.device("cpu"))
    from tests.engine.helpers import make_runner
    from engine.kv.table import PageList
    from engine.runner import Work
    ids = list(range(3, 40))
    a = make_runner(ours).run([Work(ids, 0, PageList(range(4)), "all")])[0]
    b = make_runner(oracle).run([Work(ids, 0, PageList(range(4)), "all")])[0]
    assert rel(a, b) < 3e-2  # the CPU low-bit kernels compute with bf16 activations
    requantized = LlamaModel(native, torch.float32, torch.device("cpu"), "int4")  # without keep_native
    assert requantized.layers[0].down.weight.format == "int4_asym"
