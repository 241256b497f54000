"""The memory ledger for Gated-DeltaNet hybrids read from real files: Qwen3.5 folders (flat Qwen3_5ForCausalLM and the
published Qwen3_5ForConditionalGeneration layout) and llama.cpp qwen35 GGUFs. The state a sequence holds and the KV
bytes of a token are what the engine allocates (its state pool and KV cache, counted from their tensors); a
Qwen3.5-27B-shaped config.json reads as transformers counts it; and the 12 GB presets from the field reports, planned
against it, fit or are refused with the numbers of the engine's allocation rules (engine/memory/geometry.py)."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from engine.build import build_engine
from engine.errors import ModelLoadError
from engine.ledger import GIB, KV_LAYOUTS, PAGE_SIZE, ModelShape, build_ledger
from engine.memory.geometry import WindowSpec, pads, state_slots, state_snapshots
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.runner import ModelRunner
from engine.tools import doctor
from tests.engine.test_qwen35 import checkpoint  # noqa: F401  (a fixture: the flat Qwen3_5ForCausalLM folder)
from tests.engine.test_qwen35_checkpoints import causal_lm, published  # noqa: F401  (fixtures)
from tests.engine.test_qwen35_formats import mtp_tensors, write_qwen35_gguf

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def slot_bytes(runner: ModelRunner) -> int:
    """One state slot's bytes, counted from the state pool's tensors (a slot per row, plus a scratch row if any)."""
    pool = runner.state
    rows = pool.num_slots + (pool.scratch is not None)
    return sum(t.numel() * t.element_size() for layer in pool.layers for t in layer.values()) // rows


@pytest.fixture(scope="module")
def folders(checkpoint, published):  # noqa: F811
    return {"flat": checkpoint[1], "published": published[1]}


@pytest.fixture(scope="module")
def gguf(checkpoint, tmp_path_factory):  # noqa: F811
    hf, _ = checkpoint
    path = tmp_path_factory.mktemp("ledger-gguf") / "tiny-qwen35-mtp.gguf"
    return write_qwen35_gguf(hf.state_dict(), hf.config, path, mtp=mtp_tensors(hf.config))


# ---------------------------------------------------------------- shapes from files, against the engine

def test_folder_shapes_carry_the_state_and_the_mtp_layers(folders, checkpoint, causal_lm):  # noqa: F811
    """Both layouts read as the same text model: 6 linear + 2 attention layers; the published one's MTP layer is
    counted, its vision tower and MTP weights are not in the weights line (transformers' text model's parameters)."""
    text_params = {"flat": checkpoint[0].num_parameters(), "published": causal_lm.num_parameters()}
    for name, folder in folders.items():
        shape = ModelShape.from_path(folder)
        assert (shape.layers, shape.full_attention_layers, shape.linear_layers) == (8, 2, 6), name
        assert shape.linear.num_v_heads == 4 and shape.linear.conv_dim == 2 * 2 * 16 + 4 * 16
        assert shape.mtp_layers == (name == "published")
        assert shape.params == text_params[name] and shape.stored_bytes == 4 * text_params[name]


@pytest.mark.parametrize("layout,fp16,weight_dtype", [("published", False, "auto"), ("published", True, "bf16"),
                                                      ("flat", False, "bf16"), ("flat", True, "auto")])
def test_the_ledger_of_a_folder_counts_what_the_engine_allocates(folders, layout, fp16, weight_dtype):
    """build_engine on the folder (CPU: activations fp32 with auto, bf16 with --weight-dtype bf16): the state pool's
    slot and the KV cache's page, counted from their tensors, are the shape's state and KV bytes; the state line of
    the ledger planned from the file alone is the engine's (slots x slot bytes)."""
    folder = folders[layout]
    settings = dict(weight_dtype=weight_dtype, gdn_state_fp16=fp16, max_concurrency=2, max_context=512)
    loaded = build_engine(folder, device="cpu", kv_capacity=1024, **settings)
    try:
        runner = loaded.engine.runner
        shape = ModelShape.from_path(folder).on_device(False, weight_dtype)
        assert shape.state_bytes(fp16) == slot_bytes(runner)
        assert runner.kv.num_layers == shape.full_attention_layers == 2
        assert runner.kv.page_bytes == shape.kv_bytes_per_token(loaded.ledger.kv_dtype) * PAGE_SIZE
        planned = build_ledger(shape, settings, vram_mib=0, ram_mib=8192)
        allocated = runner.state.num_slots * slot_bytes(runner)
        assert planned.line("state").bytes == loaded.ledger.line("state").bytes == allocated
        assert planned.page_bytes == loaded.ledger.page_bytes == runner.kv.page_bytes
    finally:
        loaded.engine.shutdown()



def test_a_hybrid_draft_model_counts_its_state_slots_as_the_engine_allocates(folders):
    """--spec draft with a hybrid drafter: the draft line holds its weights plus two state slots per sequence (its
    state and the checkpoint a rejection restores, engine/speculative/draft.py), as many as the engine allocates."""
    target = drafter = folders["flat"]
    settings = dict(spec="draft", draft_model=str(drafter), draft_tokens=3, max_concurrency=2, max_context=512)
    loaded = build_engine(target, device="cpu", kv_capacity=1024, **settings)
    try:
        states = loaded.engine.speculator.proposer.states
        allocated = states.num_slots * states.slot_bytes
        assert states.num_slots == 4
        shape = ModelShape.from_path(drafter).on_device(False, "auto")
        plain = build_ledger(ModelShape.from_path(target), dict(settings, spec="none"), vram_mib=0, ram_mib=8192)
        planned = build_ledger(ModelShape.from_path(target), settings, vram_mib=0, ram_mib=8192)
        assert planned.line("draft").bytes == shape.weight_bytes("auto") + allocated
        assert "recurrent state x4 slots" in planned.line("draft").name and plain.line("draft") is None
    finally:
        loaded.engine.shutdown()
@pytest.mark.parametrize("fp16", [False, True])
def test_the_shape_of_a_qwen35_gguf_counts_what_the_engine_allocates(gguf, checkpoint, fp16):  # noqa: F811
    """The GGUF read through the engine's reader: the MTP block (blk.8.nextn.*) is the MTP layer, not weights; the
    model built from the file allocates the shape's state per slot and KV per page."""
    hf, _ = checkpoint
    shape = ModelShape.from_path(gguf)
    assert shape.source == "gguf" and shape.mtp_layers == 1 and shape.linear_layers == 6
    assert shape.params == hf.num_parameters()  # the main model's tensors only
    model = build_model(load_weights(gguf)[1], torch.float32, CPU, **({"state_fp16": True} if fp16 else {}))
    runner = ModelRunner(model, 4, torch.float32, PAGE_SIZE, state_slots=2)
    assert shape.on_device(False).state_bytes(fp16) == slot_bytes(runner)
    assert runner.kv.page_bytes == shape.kv_bytes_per_token("fp32") * PAGE_SIZE
    assert ModelShape.from_path(gguf).on_device(True).state_bytes(fp16) < slot_bytes(runner)  # bf16 conv on a GPU


def test_a_moe_gguf_the_engine_does_not_read_is_refused_by_the_ledger_as_by_the_engine(checkpoint,  # noqa: F811
                                                                                        tmp_path):
    """A dense qwen35 file that claims experts (qwen35moe and qwen3next files run; their MoE placement in the
    ledger: tests/engine/test_moe_placement.py)."""
    hf, _ = checkpoint
    state = {n: t for n, t in hf.state_dict().items() if not n.startswith("model.layers.")}
    path = write_qwen35_gguf(state, hf.config, tmp_path / "moe.gguf", extra={"qwen35.expert_count": 8})
    with pytest.raises(ModelLoadError) as e:
        ModelShape.from_path(path)
    assert "claims 8 experts" in e.value.problem and "qwen35moe" in e.value.problem


@pytest.mark.parametrize("which", ["published", "gguf"])
def test_doctor_ledger_shows_the_state_line_and_kv_of_the_attention_layers(folders, gguf, capsys, which):
    path = folders["published"] if which == "published" else gguf
    argv = ["--ledger", "--model", str(path), "--vram-mib", "0", "--ram-mib", "8192", "--max-concurrency", "2",
            "--max-context", "512"]
    assert doctor.main(argv) == 0
    out = capsys.readouterr().out
    assert "8 layers: 2 full attention (2 KV heads x 32), 6 linear attention" in out
    slots, snapshots = state_slots(2), state_snapshots(2, True)  # prefix reuse is on by default
    assert "recurrent state (6 linear layers, fp32, x2 slots: 2 seq)" in out and slots == 2
    assert f"recurrent-state prefix snapshots (up to {snapshots}, host memory)" in out
    assert f"KV fp32: {2 * 2 * 2 * 32 * 4:,} B a token" in out  # 2 attention layers x K and V x 2 heads x 32 x 4 B
    assert doctor.main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    lines = {line["key"]: line for line in data["devices"]["host"]["lines"]}
    conv = 3 * (2 * 2 * 16 + 4 * 16) * 4  # fp32 activations on the CPU
    assert lines["state"]["bytes"] == slots * 6 * (4 * 16 * 16 * 4 + conv)
    assert lines["state_snapshots"]["bytes"] == snapshots * 6 * (4 * 16 * 16 * 4 + conv)
    assert data["shape"]["mtp_layers"] == 1


# ---------------------------------------------------------------- a Qwen3.5-27B-shaped config.json

QWEN35_27B_TEXT = dict(  # Qwen3.5-27B's text_config, as published (../shared/docs/GDN.md)
    hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, vocab_size=248320,
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False, attn_output_gate=True,
    mamba_ssm_dtype="float32", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True))


@pytest.fixture(scope="module")
def qwen27(tmp_path_factory):
    """The config.json alone (no weights): the ledger reads the shape from it."""
    folder = tmp_path_factory.mktemp("qwen3.5-27b") / "Qwen3.5-27B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                    "model_type": "qwen3_5", "tie_word_embeddings": False,
                                                    "text_config": QWEN35_27B_TEXT}))
    return ModelShape.from_path(folder)


# Per sequence, from GDN.md's sizing: 48 GDN layers x 48 value heads x 128 x 128 (144 MiB fp32, 72 MiB fp16) plus
# the conv window, 48 x 3 x (2 x 16 x 128 + 48 x 128) values; KV: 16 attention layers x 4 heads x 256 a token.
SSM_FP32, SSM_FP16, CONV_VALUES = 144 * 2**20, 72 * 2**20, 48 * 3 * 10240


def test_the_27b_config_reads_as_transformers_counts_it(qwen27):
    """Parameters: transformers' Qwen3_5ForCausalLM built on the meta device from the same text config (the text
    model without MTP); KV only for the 16 attention layers, 64 KiB a token in bf16; the state GDN.md gives."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    with torch.device("meta"):
        reference = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35_27B_TEXT))
    assert qwen27.params == reference.num_parameters() == ModelShape.synthetic("qwen3.5-27b-like").params
    assert (qwen27.layers, qwen27.full_attention_layers, qwen27.linear_layers, qwen27.mtp_layers) == (64, 16, 48, 1)
    assert qwen27.kv_bytes_per_token("bf16") == 64 * 1024
    assert qwen27.on_device(True).state_bytes() == SSM_FP32 + CONV_VALUES * 2
    assert qwen27.on_device(True).state_bytes(fp16=True) == SSM_FP16 + CONV_VALUES * 2
    assert qwen27.max_position == 262144


def preset(name: str) -> dict:
    with open(ROOT / "resources" / "presets" / f"{name}.toml", "rb") as f:
        return tomllib.load(f)


def plan(shape: ModelShape, settings: dict, *, ram_mib: int):
    return build_ledger(shape.on_device(True, settings.get("weight_dtype", "auto")), settings, vram_mib=12288,
                        ram_mib=ram_mib)


def check_allocation_rules(led, shape: ModelShape, s: dict) -> None:
    """The state line: geometry.state_slots slots on the GPU (the sequences, and a draft checkpoint each with
    speculation; a scratch slot when static decode batches may pad) of the per-sequence state above, and
    geometry.state_snapshots prefix snapshots in host memory; the KV line: its pages of 16 attention layers x 4 KV
    heads x 256 in the preset's KV layout."""
    conc = s["max_concurrency"]
    slots = state_slots(conc, s["spec"] != "none") + pads(conc)
    per_seq = (SSM_FP16 if s.get("gdn_state_fp16") else SSM_FP32) + CONV_VALUES * 2
    assert led.line("state").bytes == slots * per_seq and led.line("state").device == "gpu"
    snapshots = led.line("state_snapshots")
    assert (snapshots.bytes if snapshots else 0) == state_snapshots(conc, s["max_shared_prefixes"] != 0) * per_seq
    assert led.page_bytes == PAGE_SIZE * 16 * 4 * KV_LAYOUTS[s["kv_dtype"]].bytes_per_head(256)
    assert led.line("kv").bytes == led.gpu_pages * led.page_bytes


def test_12gb_mtp_preset_on_the_27b_config(qwen27):
    """Seed 1's machine (12 GiB VRAM, 31 GiB RAM). As written (weights as stored: bf16 for a Hugging Face folder)
    it is refused on the weights line, the remedy naming ternary, the one format of this engine that holds 27B in
    12 GB; with ternary weights the ledger fits: 2 state slots (the sequence, its MTP draft checkpoint, no prefix
    snapshot with --max-shared-prefixes 0), 280 k8v4 pages. The settings check refuses its --kv-capacity 17920 for
    the 16K window it asks for, naming the 403 pages (25,792 tokens) a windowed sequence owns: the pages the ledger
    wants with --kv-capacity auto."""
    from engine.config.loading import ConfigError, load_settings

    s = preset("12gb-mtp")
    led = plan(qwen27, s, ram_mib=31 * 1024)
    assert not led.fits and led.line("weights").bytes == 2 * qwen27.params
    [problem] = [p for p in led.check() if p.level == "error"]
    assert problem.line == "weights" and f"ternary {qwen27.weight_bytes('ternary') / GIB:.2f} GiB" in problem.remedy
    check_allocation_rules(led, qwen27, s)

    ternary = dict(s, weight_dtype="ternary")
    led = plan(qwen27, ternary, ram_mib=31 * 1024)
    assert led.fits and led.gpu_pages == 17920 // PAGE_SIZE and led.reach_tiered_tokens >= s["max_context"]
    check_allocation_rules(led, qwen27, ternary)
    auto = plan(qwen27, dict(ternary, kv_capacity="auto"), ram_mib=31 * 1024)
    footprint = WindowSpec.from_settings(ternary).footprint
    assert auto.fits and auto.gpu_pages == auto.kv_pages_wanted == footprint == 403
    with pytest.raises(ConfigError) as e:
        load_settings(["--preset", "12gb-mtp"], {})
    assert any(f"raise --kv-capacity to {footprint * PAGE_SIZE}" in p for p in e.value.problems)


def test_rtx3060_ternary_preset_on_the_27b_config(qwen27):
    """Seed 2's machine (12 GiB VRAM, 15 GiB RAM): ternary weights, fp16 state, rk4v4 KV, a 64K window written
    through to host memory. It fits: 2 fp16 state slots (the sequence and its MTP draft checkpoint), the 1,091 pages
    a windowed sequence owns (sink + 64K window + a 4096-token chunk + 2 edge pages), and 2,304 MiB of host pages,
    the 2,048 pages a 131,072-token sequence writes through. The seed's 2,048 MiB holds 1,820 of them: refused,
    naming the host KV line, the reach and the 2,304 MiB it needs."""
    s = preset("rtx3060-ternary")
    led = plan(qwen27, s, ram_mib=15 * 1024)
    assert led.fits, [str(p) for p in led.check()]
    check_allocation_rules(led, qwen27, s)
    assert led.gpu_pages == 1 + (65536 + 4096) // PAGE_SIZE + 2 == 1091
    assert led.host_pages == led.host_pages_needed == 131072 // PAGE_SIZE and led.reach_tokens == 131072
    assert led.spare("gpu") > 0 and led.total("host") < led.budgets["host"]

    seed = plan(qwen27, dict(s, host_kv_mib=2048), ram_mib=15 * 1024)
    [problem] = [p for p in seed.check() if p.level == "error"]
    assert problem.line == "host_kv" and seed.host_pages == 2048 * 2**20 // seed.page_bytes == 1820
    assert f"reaches {1820 * PAGE_SIZE:,} tokens" in problem.message and "--host-kv-mib to 2,304" in problem.remedy
