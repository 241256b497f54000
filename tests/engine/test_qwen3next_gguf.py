"""qwen3next GGUF files (Qwen3-Next as llama.cpp's converter writes it: tests/engine/qwen3next_models.py, the facts in
engine/model/gguf_qwen3next.py) against transformers' Qwen3NextForCausalLM on a tiny seeded random checkpoint (fp32;
4 layers of 3 GDN : 1 gated attention, GDN 4 value heads over 2 key heads, 7 experts (odd), top 3, a shared expert,
routers far from uniform), and against the engine on the same weights as an HF folder. The layouts: the later
converters' attn_qkv + attn_gate with the grouped ssm_ba; the older converter's grouped ssm_in (and no
full_attention_interval); the experts' gate and up merged as ffn_gate_up_exps; Q8_0 linear weights."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.errors import ModelLoadError
from engine.model.config import MoEConfig
from engine.model.loader import load_weights
from engine.model.registry import build_model
from tests.engine.helpers import hf_greedy, hf_logits, rel_err
from tests.engine.qwen35_models import VOCAB
from tests.engine.qwen3next_models import tiny_next_checkpoint, write_next_gguf
from tests.engine.test_qwen35_formats import greedy_tokens
from tests.engine.test_qwen35_moe import chunked_logits

CPU = torch.device("cpu")
LAYOUTS = {"attn_qkv-and-gate": {}, "legacy-ssm_in": {"legacy": True, "interval": False},
           "gate_up_exps": {"merged": True}}


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, VOCAB, n)]


@pytest.fixture(scope="module")
def next_moe(tmp_path_factory):
    return tiny_next_checkpoint(tmp_path_factory.mktemp("qwen3next") / "tiny-qwen3-next", seed=3)


@pytest.fixture(scope="module")
def folder_model(next_moe):
    return build_model(load_weights(next_moe[1])[1], torch.float32, CPU)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gguf_file(request, next_moe, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3next-gguf") / f"tiny-qwen3next-{request.param}-F32.gguf"
    return write_next_gguf(next_moe[0], path, **LAYOUTS[request.param])


def test_config_and_tensors_read_as_the_folders(next_moe, gguf_file):
    """The same config as the folder's (every layer MoE, top k renormalised, the 3:1 layer kinds also without
    full_attention_interval, a quarter of each head rotated) and the same tensors, the grouped projections cut."""
    ours, ref = load_weights(gguf_file)[1], load_weights(next_moe[1])[1]
    cfg = ours.config
    assert cfg.arch == "qwen35" and cfg.extra["gguf_arch"] == "qwen3next"
    assert cfg.moe == MoEConfig(7, 3, 32, 48, True, (0, 1, 2, 3)) and cfg.partial_rotary == 0.25
    assert cfg.layer_kinds == ("recurrent",) * 3 + ("attention",)
    assert replace(cfg, name=ref.config.name, rms_eps=ref.config.rms_eps) == ref.config
    assert ours.tensors.keys() == ref.tensors.keys()
    for name, t in ref.tensors.items():  # the stored norms' + 1 and ssm_a's -exp round in float32
        assert torch.allclose(ours.tensors[name], t, rtol=1e-6, atol=1e-6), name
    assert ours.storage["model.layers.0.linear_attn.in_proj_b.weight"] == "F32"


def test_logits_match_transformers_and_the_folder(next_moe, folder_model, gguf_file):
    """Prefill in two chunks, then one-token decode steps through the runner's state pool."""
    hf, _ = next_moe
    model = build_model(load_weights(gguf_file)[1], torch.float32, CPU)
    ids, chunks = tokens(1, 96), [64, 26] + [1] * 6
    ours = chunked_logits(model, ids, chunks)
    assert rel_err(ours, hf_logits(hf, ids)) <= 1e-4
    assert rel_err(ours, chunked_logits(folder_model, ids, chunks)) <= 1e-5


def test_greedy_tokens_are_transformers_and_the_folders(next_moe, folder_model, gguf_file):
    hf, _ = next_moe
    model = build_model(load_weights(gguf_file)[1], torch.float32, CPU)
    ids = tokens(2, 40)
    out = greedy_tokens(model, ids, 16)
    assert out == hf_greedy(hf, ids, 16) == greedy_tokens(folder_model, ids, 16)


def test_q8_0_grouped_projections_keep_their_blocks(next_moe, tmp_path):
    """Q8_0 ssm_in / ssm_ba cut by whole rows: the parts keep the file's blocks (int8 as stored) and decode to
    exactly what the decoded path reads; the int8 model stays close to the decoded one."""
    from kernels.quant import QuantizedWeight, dequantize

    path = write_next_gguf(next_moe[0], tmp_path / "tiny-qwen3next-Q8_0.gguf", legacy=True, q8_0=True)
    native, dense = load_weights(path, native=True)[1], load_weights(path)[1]
    for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        name = f"model.layers.1.linear_attn.{part}.weight"
        assert isinstance(native.tensors[name], QuantizedWeight) and native.storage[name] == "Q8_0 -> int8", name
        assert torch.equal(dequantize(native.tensors[name], torch.float32), dense.tensors[name]), name
    ids = tokens(3, 70)
    ref = chunked_logits(build_model(dense, torch.float32, CPU), ids, [70])
    ours = chunked_logits(build_model(native, torch.float32, CPU, "int8", keep_native=True), ids, [70])
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-2  # the CPU int8 kernels round activations to bf16


@pytest.mark.parametrize("skip,swap,expected", [
    (("blk.0.ssm_ba.weight",), None, "missing model.layers.0.linear_attn.in_proj_b.weight (blk.0.ssm_ba.weight)"),
    ((), {"blk.1.ssm_ba.weight": np.zeros((4, 64), np.float32)},
     "tensor blk.1.ssm_ba.weight has shape (4, 64), expected (8, 64)"),
    ((), {"blk.2.ssm_in.weight": np.zeros((128, 64), np.float32)},
     "tensor blk.2.ssm_in.weight has shape (128, 64), expected (192, 64)"),
])
def test_a_missing_or_misshaped_grouped_tensor_is_refused(next_moe, tmp_path, skip, swap, expected):
    path = write_next_gguf(next_moe[0], tmp_path / "broken.gguf", legacy=True, skip=skip, replace=swap)
    with pytest.raises(ModelLoadError) as info:
        load_weights(path)
    assert expected in str(info.value) and "broken.gguf" in str(info.value), str(info.value)


def test_inspect_fit_and_the_ledger_take_it_as_runnable(next_moe, tmp_path):
    """The library lists it as runnable and marks its fit from the header (also without full_attention_interval:
    llama.cpp's every fourth layer); the ledger's shape counts 3 linear-attention layers."""
    from engine.ledger import ModelShape
    from engine.library import fit
    from engine.library.header import read_local_header
    from engine.library.local import describe
    from engine.model.inspect import inspect

    path = write_next_gguf(next_moe[0], tmp_path / "Tiny-Qwen3-Next-F32.gguf", interval=False)
    info = inspect(path)
    assert info.config.moe.num_experts == 7 and info.params == next_moe[0].num_parameters()
    assert describe(path, "folder", path.name).supported
    header = read_local_header(path)
    assert fit.shape_from_header(header, path.name).full_attention_layers == 1
    marked = fit.mark_header(header, path.name, vram_mib=0, ram_mib=8000)
    assert marked.mark != fit.UNSUPPORTED, marked.detail
    assert ModelShape.from_path(path).linear_layers == 3
