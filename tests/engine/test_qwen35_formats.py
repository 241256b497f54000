"""Qwen3.5-class Gated-DeltaNet hybrids from the other files they come in, against transformers on tiny random
checkpoints (fp32; perturbed norms, A_log and dt_bias; 4 value heads over 2 key heads; 3 GDN : 1 attention layers):
- GGUF files of architecture qwen35, written here as llama.cpp's converter writes them: its tensor names (from the
  gguf package's own name map), norms stored as 1 + w, ssm_a = -exp(A_log), the conv kernel squeezed to 2-D, V heads
  in its tiled order, MTP blocks appended as blk.{L}.nextn.*; F32, and Q8_0 linear weights;
- Qwen3-Next folders (grouped in_proj_qkvz / in_proj_ba) whose layers are all dense;
- and the refusals: a dense qwen35 GGUF that claims experts, GGUF files with a missing or mis-shaped GDN tensor
  (qwen3next GGUFs run: tests/engine/test_qwen3next_gguf.py)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import ModelLoadError
from engine.memory.state import SeqState
from engine.model.formats import weight_format
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.runner import ModelRunner, Work
from tests.engine.helpers import rel_err
from tests.engine.qwen35_models import perturb
from tests.engine.test_qwen35 import VOCAB, checkpoint, hf_logits, tokens  # noqa: F401  (checkpoint: a fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CPU = torch.device("cpu")
PROMPT = 131  # odd, and more than two 64-token chunks


# ---------------------------------------------------------------- a GGUF writer with llama.cpp's conventions

def _tiled(t: torch.Tensor, dim: int, k_heads: int, v_heads: int, width: int) -> torch.Tensor:
    """V heads grouped by key head -> llama.cpp's tiled order, along `dim` (as its converter reorders them)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, v_heads // k_heads, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def converted(hf_name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    """An HF tensor in the form llama.cpp's converter stores it for qwen35."""
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    if ".linear_attn." in hf_name and nk != nv:
        if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = torch.cat([t[:2 * nk * dk], _tiled(t[2 * nk * dk:], 0, nk, nv, dv)])
        elif hf_name.endswith("in_proj_z.weight"):
            t = _tiled(t, 0, nk, nv, dv)
        elif hf_name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            t = _tiled(t, 0, nk, nv, 1)
        elif hf_name.endswith("out_proj.weight"):
            t = _tiled(t, 1, nk, nv, dv)
    if hf_name.endswith("A_log"):
        return -torch.exp(t)
    if "conv1d" in hf_name:
        return t.squeeze()
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return t + 1
    return t


def gguf_tensor_name(hf_name: str, layers: int, blocks: int) -> str:
    """llama.cpp's name: MTP tensors first renamed as its converter does, then the gguf package's name map."""
    import gguf

    nextn = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
             "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}
    if hf_name in nextn:
        return f"blk.{layers}.{nextn[hf_name]}"
    if hf_name.startswith("mtp.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        hf_name = f"model.layers.{layers + int(i)}.{rest}"
    if hf_name.endswith(".dt_bias"):
        hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    mapped = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, blocks).get_name(hf_name, try_suffixes=(".weight",
                                                                                                       ".bias"))
    assert mapped is not None, hf_name
    return mapped


def write_qwen35_gguf(state: dict[str, torch.Tensor], cfg, path: Path, *, mtp: dict | None = None,
                      q8_0: bool = False, skip: tuple[str, ...] = (), replace: dict | None = None,
                      arch: str = "qwen35", extra: dict | None = None, metadata=None) -> Path:
    """A transformers Qwen3.5 state dict as a qwen35 GGUF (F32, or Q8_0 linear weights); `mtp`: HF-named MTP
    tensors appended as one nextn block; `skip` / `replace`: GGUF tensors left out or replaced; `metadata(writer)`
    adds more keys (a vocabulary)."""
    import gguf

    layers, blocks = cfg.num_hidden_layers, cfg.num_hidden_layers + (1 if mtp else 0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-qwen35")
    w.add_block_count(blocks)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(cfg.head_dim * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections([*rope.get("mrope_section", [2, 1, 1]), 0])
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(4)
    if mtp:
        w.add_nextn_predict_layers(1)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    if metadata is not None:
        metadata(w)
    for hf_name, t in {**state, **(mtp or {})}.items():
        name = gguf_tensor_name(hf_name, layers, blocks)
        if name in skip:
            continue
        arr = (replace or {}).get(name)
        arr = converted(hf_name, t.detach().float(), cfg).numpy() if arr is None else arr
        if q8_0 and arr.ndim == 2 and arr.shape[1] % 32 == 0 and "conv1d" not in name and "token_embd" not in name:
            w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q8_0_roundtrip(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The HF weights as a Q8_0 file stores them: what the Q8_0 GGUF's transformers twin runs. Blocks of 32 run
    along the stored rows: out_proj's columns are quantized in their tiled order (reordering them back is the same
    reorder with the roles of key heads and value heads per key head swapped)."""
    import gguf

    nk, nv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    out = {}
    for name, t in state.items():
        if t.ndim == 2 and t.shape[1] % 32 == 0 and "embed_tokens" not in name:
            tiled = name.endswith("linear_attn.out_proj.weight")
            stored = _tiled(t.float(), 1, nk, nv, dv) if tiled else t.float()
            q = gguf.quants.quantize(stored.numpy(), gguf.GGMLQuantizationType.Q8_0)
            t = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(t.shape).copy())
            t = _tiled(t, 1, nv // nk, nv, dv) if tiled else t
        out[name] = t
    return out


# ---------------------------------------------------------------- running a model

def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, 4, torch.float32, 64, state_slots=1)
    pages = runner.pool.allocate(-(-len(ids) // 64) + 1)
    return runner.run([Work(ids, 0, pages, "all", SeqState(runner.state.allocate()))])[0]


def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    """Prefill, then n - 1 one-token decode steps from the state pool, taking the argmax each time."""
    runner = ModelRunner(model, 4, torch.float32, 64, state_slots=1)
    pages, state = runner.pool.allocate(-(-(len(ids) + n) // 64) + 1), SeqState(runner.state.allocate())
    out = [int(runner.run([Work(ids, 0, pages, "all", state)])[0][-1].argmax())]
    while len(out) < n:
        out.append(int(runner.run([Work(out[-1:], len(ids) + len(out) - 1, pages, "all", state)])[0][-1].argmax()))
    return out


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return ref[0, len(ids):].tolist()


def mtp_tensors(cfg, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random HF-named MTP tensors of a Qwen3.5 checkpoint (transformers drops them on load): fc, its norms and one
    full-attention decoder layer (q_proj with the per-head gate)."""
    g = torch.Generator().manual_seed(seed)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
              "mtp.layers.0.input_layernorm.weight": (h,), "mtp.layers.0.post_attention_layernorm.weight": (h,),
              "mtp.layers.0.self_attn.q_proj.weight": (2 * cfg.num_attention_heads * hd, h),
              "mtp.layers.0.self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
              "mtp.layers.0.self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
              "mtp.layers.0.self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
              "mtp.layers.0.self_attn.q_norm.weight": (hd,), "mtp.layers.0.self_attn.k_norm.weight": (hd,),
              "mtp.layers.0.mlp.gate_proj.weight": (inter, h), "mtp.layers.0.mlp.up_proj.weight": (inter, h),
              "mtp.layers.0.mlp.down_proj.weight": (h, inter)}
    return {n: 0.3 * torch.randn(s, generator=g) for n, s in shapes.items()}


# ---------------------------------------------------------------- GGUF qwen35

@pytest.fixture(scope="module")
def gguf_f32(checkpoint, tmp_path_factory):  # noqa: F811
    hf, _ = checkpoint
    path = tmp_path_factory.mktemp("qwen35-gguf") / "tiny-qwen35-F32.gguf"
    return write_qwen35_gguf(hf.state_dict(), hf.config, path)


def test_gguf_config_reads_as_the_folders(checkpoint, gguf_f32):  # noqa: F811
    from dataclasses import replace

    _, folder = checkpoint
    ours = load_weights(gguf_f32)[1].config
    ref = load_weights(folder)[1].config
    assert ours.arch == "qwen35" and ours.layer_kinds == ("recurrent",) * 3 + ("attention",) + ("recurrent",) * 3 + \
        ("attention",)
    assert ours.rms_eps == pytest.approx(ref.rms_eps)  # GGUF stores it as float32
    # llama.cpp always writes rope.dimension_sections (M-RoPE for images); a text-only folder has no mrope_section
    assert ours.mrope_section == (2, 1, 1) and ref.mrope_section == ()
    assert replace(ours, name=ref.name, rms_eps=ref.rms_eps, mrope_section=()) == ref


def test_gguf_logits_and_greedy_tokens_match_transformers(checkpoint, gguf_f32):  # noqa: F811
    hf, _ = checkpoint
    model = build_model(load_weights(gguf_f32)[1], torch.float32, CPU)
    ids = tokens(61, PROMPT)
    assert rel_err(prefill_logits(model, ids), hf_logits(hf, ids)) <= 1e-4
    ids = tokens(62, 70)
    assert greedy_tokens(model, ids, 12) == hf_greedy(hf, ids, 12)


@pytest.fixture(scope="module")
def q8_0(checkpoint, tmp_path_factory):  # noqa: F811
    """A Q8_0 GGUF of the checkpoint, and transformers over the same (dequantized) weights."""
    from transformers import Qwen3_5ForCausalLM

    hf, _ = checkpoint
    path = write_qwen35_gguf(hf.state_dict(), hf.config, tmp_path_factory.mktemp("qwen35-q8") / "tiny-Q8_0.gguf",
                             q8_0=True)
    twin = Qwen3_5ForCausalLM(hf.config).eval()
    twin.load_state_dict(q8_0_roundtrip(hf.state_dict(), hf.config))
    return path, twin


def test_q8_0_gguf_decoded_matches_transformers_on_the_same_weights(q8_0):
    path, twin = q8_0
    ids = tokens(63, PROMPT)
    model = build_model(load_weights(path)[1], torch.float32, CPU)
    assert rel_err(prefill_logits(model, ids), hf_logits(twin, ids)) <= 1e-4


def test_q8_0_gguf_kept_as_stored_runs_close_to_transformers(q8_0):
    """Native: the Q8_0 blocks become int8 weights as stored (V rows reordered as whole rows); out_proj's tiled
    columns are 16 wide, under a 32-column block, so it is decoded and reordered instead."""
    from kernels.quant import QuantizedWeight

    path, twin = q8_0
    weights = load_weights(path, native=True)[1]
    t = weights.tensors
    assert isinstance(t["model.layers.0.linear_attn.in_proj_qkv.weight"], QuantizedWeight)
    assert isinstance(t["model.layers.0.linear_attn.in_proj_b.weight"], QuantizedWeight)
    assert not isinstance(t["model.layers.0.linear_attn.out_proj.weight"], QuantizedWeight)
    model = build_model(weights, torch.float32, CPU, weight_format("auto", weights), keep_native=True)
    ids = tokens(64, PROMPT)
    ours, ref = prefill_logits(model, ids), hf_logits(twin, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-2  # the CPU int8 kernels round activations to bf16
    assert (ours[-8:].argmax(-1) == ref[-8:].argmax(-1)).float().mean() >= 0.75


def test_native_q8_0_moves_whole_blocks_where_a_value_head_spans_them(tmp_path):
    """Value heads 32 wide (one Q8_0 block): out_proj keeps its Q8_0 blocks, its tiled columns reordered block by
    block, and decodes to exactly what the decoded path (checked against transformers above) reads."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from kernels.quant import QuantizedWeight, dequantize

    cfg = Qwen3_5TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=32,
                            layer_types=["linear_attention"] * 3 + ["full_attention"],
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    hf = Qwen3_5ForCausalLM(cfg).eval()
    path = write_qwen35_gguf(hf.state_dict(), cfg, tmp_path / "wide-Q8_0.gguf", q8_0=True)
    native, dense = load_weights(path, native=True)[1].tensors, load_weights(path)[1].tensors
    for part in ("out_proj", "in_proj_qkv", "in_proj_z", "in_proj_a"):
        name = f"model.layers.0.linear_attn.{part}.weight"
        assert isinstance(native[name], QuantizedWeight), name
        assert torch.equal(dequantize(native[name], torch.float32), dense[name]), name


def test_gguf_mtp_block_loads_under_the_mtp_names(checkpoint, tmp_path):  # noqa: F811
    """block_count counts the MTP block; its nextn tensors and its layer land under mtp.* with HF's shapes and
    values (norms without the stored + 1); the main model is unchanged."""
    hf, _ = checkpoint
    mtp = mtp_tensors(hf.config)
    path = write_qwen35_gguf(hf.state_dict(), hf.config, tmp_path / "mtp.gguf", mtp=mtp)
    weights = load_weights(path)[1]
    assert weights.config.num_layers == hf.config.num_hidden_layers
    got = {n: t for n, t in weights.tensors.items() if n.startswith("mtp.")}
    assert sorted(got) == sorted(mtp)
    for name, ref in mtp.items():
        assert tuple(got[name].shape) == tuple(ref.shape), name
        assert torch.allclose(got[name], ref, atol=1e-6), name
    ids = tokens(65, 80)
    model = build_model(weights, torch.float32, CPU)
    assert rel_err(prefill_logits(model, ids), hf_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("arch,expected,remedy", [
    ("qwen35", ["'qwen35'", "claims 8 experts", "qwen35moe"], "convert it again"),
])
def test_moe_gguf_layouts_not_read_are_refused(checkpoint, tmp_path, arch, expected, remedy):  # noqa: F811
    """qwen35moe and qwen3next files run (tests/engine/test_qwen35_moe.py, test_qwen3next_gguf.py); a dense qwen35
    one that claims experts is refused naming what it is."""
    hf, _ = checkpoint
    state = {n: t for n, t in hf.state_dict().items() if not n.startswith("model.layers.")}
    path = write_qwen35_gguf(state, hf.config, tmp_path / f"{arch}.gguf", arch=arch,
                             extra={f"{arch}.expert_count": 8})
    with pytest.raises(ModelLoadError) as info:
        load_weights(path)
    msg = str(info.value)
    assert all(e in msg for e in expected), msg
    assert remedy in info.value.remedy


@pytest.mark.parametrize("skip,replace,expected", [
    (("blk.0.ssm_a",), None, "missing model.layers.0.linear_attn.A_log (blk.0.ssm_a)"),
    (("blk.4.ssm_alpha.weight",), None, "missing model.layers.4.linear_attn.in_proj_a.weight (blk.4.ssm_alpha.weight)"),
    ((), {"blk.1.ssm_conv1d.weight": np.zeros((128, 3), np.float32)},
     "model.layers.1.linear_attn.conv1d.weight (blk.1.ssm_conv1d.weight) has shape (128, 1, 3), expected (128, 1, 4)"),
    ((), {"blk.2.attn_qkv.weight": np.zeros((96, 64), np.float32)},
     "model.layers.2.linear_attn.in_proj_qkv.weight (blk.2.attn_qkv.weight) has shape (96, 64), expected (128, 64)"),
    ((), {"blk.0.ssm_a": np.ones(4, np.float32)}, "tensor blk.0.ssm_a cannot be read: ssm_a must hold -exp(A_log)"),
])
def test_gguf_with_a_missing_or_misshaped_gdn_tensor_is_refused(checkpoint, tmp_path, skip, replace,  # noqa: F811
                                                                 expected):
    hf, _ = checkpoint
    path = write_qwen35_gguf(hf.state_dict(), hf.config, tmp_path / "broken.gguf", skip=skip, replace=replace)
    with pytest.raises(ModelLoadError) as info:
        load_weights(path)
    assert expected in str(info.value) and "broken.gguf" in str(info.value), str(info.value)


# ---------------------------------------------------------------- Qwen3-Next folders

def qwen3_next_config(**overrides):
    from transformers import Qwen3NextConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              max_position_embeddings=4096, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=list(range(8)),
              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen3NextConfig(**(kw | overrides))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """A dense Qwen3-Next: 4 experts configured, but every layer in mlp_only_layers (transformers builds dense
    MLPs)."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(1)
    hf = Qwen3NextForCausalLM(qwen3_next_config()).eval()
    perturb(hf)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    folder = tmp_path_factory.mktemp("qwen3next") / "tiny-qwen3-next"
    hf.save_pretrained(folder)
    return hf, folder


def test_dense_qwen3_next_folder_matches_transformers(qwen3_next):
    hf, folder = qwen3_next
    weights = load_weights(folder)[1]
    assert weights.config.arch == "qwen35" and weights.config.partial_rotary == 0.25
    assert not any("in_proj_qkvz" in n or "in_proj_ba" in n for n in weights.tensors)
    model = build_model(weights, torch.float32, CPU)
    ids = tokens(71, PROMPT)
    assert rel_err(prefill_logits(model, ids), hf_logits(hf, ids)) <= 1e-4
    ids = tokens(72, 70)
    assert greedy_tokens(model, ids, 12) == hf_greedy(hf, ids, 12)


def _folder_with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(raw | changes))
    return dst


@pytest.mark.parametrize("changes,layers", [
    ({"mlp_only_layers": [0, 1, 2]}, (3, 4, 5, 6, 7)),
    ({"mlp_only_layers": [], "decoder_sparse_step": 2}, (1, 3, 5, 7)),
    ({"mlp_only_layers": None}, (0, 1, 2, 3, 4, 5, 6, 7)),
])
def test_qwen3_next_moe_layers_are_read_as_transformers_builds_them(qwen3_next, tmp_path, changes, layers):
    """The MoE layers' config (their logits against transformers: tests/engine/test_qwen35_moe.py)."""
    from engine.model.hf_folder import read_config

    moe = read_config(_folder_with_config(qwen3_next[1], tmp_path / "moe", **changes)).moe
    assert moe.layers == layers and (moe.num_experts, moe.top_k, moe.expert_size, moe.shared_size) == (4, 2, 32, 32)


def test_qwen3_next_folder_without_experts_reads_as_dense(qwen3_next, tmp_path):
    """num_experts 0: transformers builds dense MLPs whatever mlp_only_layers says; a config.json that leaves
    num_experts out gets transformers' default (512)."""
    from engine.model.hf_folder import read_config

    dense = _folder_with_config(qwen3_next[1], tmp_path / "dense", num_experts=0, mlp_only_layers=[])
    assert read_config(dense).arch == "qwen35" and read_config(dense).moe is None
    raw = json.loads((qwen3_next[1] / "config.json").read_text())
    raw.pop("num_experts")
    raw["mlp_only_layers"] = []
    (tmp_path / "default").mkdir()
    (tmp_path / "default" / "config.json").write_text(json.dumps(raw))
    assert read_config(tmp_path / "default").moe.num_experts == 512
