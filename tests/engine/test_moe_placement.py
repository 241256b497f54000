"""Where a mixture-of-experts model's experts live: --cpu-moe / --n-cpu-moe keep the routed experts of the first N
MoE layers in host memory, computed on the CPU; the ledger counts them on the host, and --fit picks the fewest
layers that let the rest fit the GPU (engine/ledger/placement.py). Without a GPU here the GPU is a budget handed to
the ledger, and the host path runs with the model on the CPU."""
from __future__ import annotations

import logging

import pytest
import torch

from engine.build import build_engine
from engine.ledger import ModelShape, build_ledger
from engine.ledger.placement import FIT_MIN_CONTEXT, fit_experts
from engine.model.config import LinearAttentionConfig, ModelConfig, MoEConfig
from engine.model.loader import load_weights
from engine.model.registry import build_model
from kernels.quant import QuantizedWeight
from tests.engine.test_qwen35_moe import chunked_logits, moe, tokens  # noqa: F401  (moe: a fixture)

CPU = torch.device("cpu")
GIB = 2**30


def qwen36_35b_a3b() -> ModelConfig:
    """Qwen3.5/3.6-35B-A3B's shape (its published config): 40 layers (3 GDN : 1 gated attention), 256 experts of 512,
    top 8, a shared expert of 512."""
    return ModelConfig(arch="qwen35", vocab_size=248320, hidden_size=2048, num_layers=40, num_heads=16,
                       num_kv_heads=2, head_dim=256, intermediate_size=0, max_position=262144, name="35B-A3B",
                       layer_kinds=(("recurrent",) * 3 + ("attention",)) * 10,
                       linear=LinearAttentionConfig(16, 32, 128, 128, 4), partial_rotary=0.25,
                       moe=MoEConfig(256, 8, 512, 512, True, tuple(range(40))))


@pytest.fixture(scope="module")
def big():
    return ModelShape.from_config(qwen36_35b_a3b())


def test_the_shape_knows_its_experts(big):
    assert big.moe_layers == 40 and big.experts == (256, 8)
    assert big.expert_params == 40 * 256 * 3 * 2048 * 512
    assert 34.0e9 < big.params < 35.0e9  # 34.7B without the MTP layer and the vision tower
    assert big.expert_bytes("int4", 10) == pytest.approx(big.weight_bytes("int4") * big.expert_params / big.params / 4,
                                                         abs=1)


def test_host_experts_run_as_the_model_with_everything_in_one_place(moe):  # noqa: F811
    weights = load_weights(moe[1])[1]
    one = build_model(weights, torch.float32, CPU)
    split = build_model(weights, torch.float32, CPU, host_experts=2)
    assert split.host_layers == {0, 1}
    assert [layer.moe.host for layer in split.layers] == [True, True, False, False]
    ids = tokens(11, 70)
    for chunks in ([70], [30, 1, 1, 38]):
        assert torch.equal(chunked_logits(split, ids, chunks), chunked_logits(one, ids, chunks))


@pytest.mark.parametrize("dtype,fmt,host_dtype", [(torch.bfloat16, "", torch.bfloat16),
                                                 (torch.float32, "int8", torch.float32)])
def test_host_experts_keep_the_models_format(moe, dtype, fmt, host_dtype):  # noqa: F811
    """A dense bf16 model's host experts stay bf16 (half the bytes of float32); low-bit experts stay low-bit and
    compute in float32, as the CPU kernels take it; the router stays float32 beside either."""
    net = build_model(load_weights(moe[1])[1], dtype, CPU, fmt, host_experts=1)
    block = net.layers[0].moe
    w = block.experts[0].gate_up.weight
    assert block.host_dtype == host_dtype and block.router.dtype == torch.float32
    assert isinstance(w, QuantizedWeight) if fmt else w.dtype == host_dtype
    assert torch.isfinite(chunked_logits(net, tokens(12, 20), [20]) if dtype == torch.float32 else
                          net.layers[0].moe(torch.randn(3, 64, dtype=dtype))).all()


def test_the_ledger_counts_the_host_experts_as_the_model_allocates_them(moe):  # noqa: F811
    weights = load_weights(moe[1])[1]
    net = build_model(weights, torch.float32, CPU, host_experts=3)
    host = sum(net.layers[i].moe.expert_bytes() for i in net.host_layers)
    shape = ModelShape.from_config(weights.config)
    ledger = build_ledger(shape, vram_mib=8192, ram_mib=8192, weight_dtype="fp32", n_cpu_moe=3)
    assert ledger.line("host_experts").bytes == host and ledger.line("host_experts").device == "host"
    assert ledger.line("weights").bytes == 4 * shape.params - host and ledger.line("weights").device == "gpu"
    everything = build_ledger(shape, vram_mib=8192, ram_mib=8192, weight_dtype="fp32", cpu_moe=True)
    assert everything.line("host_experts").bytes == 4 * shape.expert_params
    assert "4 of 4 MoE layers" in everything.line("host_experts").name
    on_cpu = build_ledger(shape, vram_mib=0, ram_mib=8192, weight_dtype="fp32", n_cpu_moe=3)
    assert on_cpu.line("host_experts") is None and on_cpu.line("weights").bytes == 4 * shape.params


def test_a_gpu_too_small_is_told_which_n_cpu_moe_fits(big):
    ledger = build_ledger(big, vram_mib=12288, ram_mib=65536, weight_dtype="int4", max_context=8192)
    assert not ledger.fits
    problem = next(p for p in ledger.check() if p.line == "weights")
    n = int(problem.remedy.split("--n-cpu-moe ")[1].split()[0])
    moved = build_ledger(big, vram_mib=12288, ram_mib=65536, weight_dtype="int4", max_context=8192, n_cpu_moe=n)
    fewer = build_ledger(big, vram_mib=12288, ram_mib=65536, weight_dtype="int4", max_context=8192, n_cpu_moe=n - 1)
    assert moved.line("weights").bytes <= 12288 * 2**20 - 1024 * 2**20 < fewer.line("weights").bytes


@pytest.mark.parametrize("vram_gib", [8, 12, 16, 24])
def test_fit_picks_the_fewest_host_layers_that_fit(big, vram_gib):
    plan = fit_experts(big, {"weight_dtype": "int4", "max_concurrency": 1}, vram_mib=vram_gib * 1024,
                       ram_mib=64 * 1024)
    assert plan.host_layers is not None and plan.ledger.fits and plan.context >= FIT_MIN_CONTEXT
    assert plan.ledger.total("gpu") <= vram_gib * GIB
    if plan.host_layers:
        assert plan.ledger.line("host_experts").bytes == big.expert_bytes("int4", plan.host_layers)
        assert f"{plan.host_layers} of 40 MoE layers" in plan.why
        fewer = build_ledger(big, {"weight_dtype": "int4", "max_concurrency": 1}, vram_mib=vram_gib * 1024,
                             ram_mib=64 * 1024, n_cpu_moe=plan.host_layers - 1, max_context=FIT_MIN_CONTEXT,
                             kv_dtype=plan.kv_dtype)
        assert not fewer.fits
    else:
        assert "whole model fits" in plan.why


@pytest.mark.parametrize("vram_gib,max_context", [(12, 0), (16, 262144), (20, 0)])
def test_fit_picks_the_8_bit_kv_where_it_moves_fewer_experts_or_holds_more(big, vram_gib, max_context):
    """--kv-dtype auto: the plan holds its context in k8v8 where that needs fewer experts on the host (a context
    asked for) or gives a longer context (the context left to the model), and the ledger it returns is that one; a
    KV dtype the user set is kept."""
    settings = {"weight_dtype": "int4", "max_concurrency": 1, "max_context": max_context}
    plan = fit_experts(big, settings, vram_mib=vram_gib * 1024, ram_mib=64 * 1024)
    kept = fit_experts(big, {**settings, "kv_dtype": "bf16"}, vram_mib=vram_gib * 1024, ram_mib=64 * 1024)
    assert (plan.kv_dtype, kept.kv_dtype) == ("k8v8", "bf16")
    assert plan.ledger.kv_dtype == "k8v8" and plan.ledger.fits and plan.ledger.total("gpu") <= vram_gib * GIB
    assert "the KV in k8v8" in plan.why and "k8v8" not in kept.why
    if max_context:
        assert plan.context == kept.context == max_context and plan.host_layers < kept.host_layers
    else:
        assert plan.host_layers == kept.host_layers and plan.context > kept.context


def test_fit_keeps_the_float_kv_where_both_hold_the_whole_context(big):
    plan = fit_experts(big, {"weight_dtype": "int4", "max_concurrency": 1}, vram_mib=28 * 1024, ram_mib=64 * 1024)
    assert (plan.host_layers, plan.context, plan.kv_dtype) == (0, big.max_position, "auto")
    assert plan.ledger.kv_dtype == "bf16"


def test_the_fitted_kv_dtype_sizes_the_engine(moe, monkeypatch):  # noqa: F811
    """What --fit chose reaches the allocation: load_model returns it (kv_name, the KV cache's dtype) and
    assemble_engine sizes and builds the pools in it. Without a GPU here, the fit is handed a GPU whose budget holds
    the model only with 8-bit KV (the ledger on that budget, checked first)."""
    import engine.build as build
    from engine.build import assemble_engine, load_model
    from engine.ledger.placement import Placement

    real = build.fit_experts
    chosen = []

    def fit_on_the_cpu(shape, settings, *, vram_mib, ram_mib):
        plan = real(shape, settings, vram_mib=vram_mib, ram_mib=ram_mib)
        chosen.append(plan)
        return Placement(0, plan.context, plan.ledger, plan.why, "k8v8")

    monkeypatch.setattr(build, "fit_experts", fit_on_the_cpu)
    cfg = load_weights(moe[1])[1].config
    assert build.experts_on_host(cfg, torch.device("cpu"), build.EngineConfig(), moe[1]) == (0, "auto")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * GIB, 8 * GIB))
    assert build.experts_on_host(cfg, torch.device("cuda"), build.EngineConfig(), moe[1]) == (0, "k8v8")
    assert chosen and chosen[0].host_layers == 0
    monkeypatch.setattr(build, "experts_on_host", lambda *a: (0, "k8v8"))
    model = load_model(moe[1], device="cpu", max_context=256, max_concurrency=1)
    assert model.kv_name == "k8v8" and model.settings.kv_dtype == "auto"
    loaded = assemble_engine(model)
    try:
        assert loaded.ledger.kv_dtype == "k8v8" and loaded.engine.runner.kv.kv_dtype == model.kv_dtype
        assert loaded.ledger.page_bytes == ModelShape.from_config(cfg).kv_bytes_per_token("k8v8") * 64
    finally:
        loaded.engine.shutdown()


def test_fit_refuses_a_model_that_cannot_fit_with_the_numbers(big):
    plan = fit_experts(big, {"weight_dtype": "int4"}, vram_mib=1536, ram_mib=64 * 1024)
    assert plan.host_layers is None and "does not fit even with every expert in host memory" in plan.why
    assert "GiB" in plan.why


def test_the_settings_say_what_they_do_on_the_cpu_and_on_a_dense_model(moe, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="ninfer")
    loaded = build_engine(moe[1], device="cpu", max_context=256, max_concurrency=1, n_cpu_moe=2)
    loaded.engine.shutdown()
    assert "--n-cpu-moe 2: the model runs on the CPU, its experts are in host memory already" in caplog.text
    from engine.build import experts_on_host
    from engine.config.engine_config import EngineConfig

    dense = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                        head_dim=4, intermediate_size=8)
    caplog.clear()
    assert experts_on_host(dense, torch.device("cuda"), EngineConfig(cpu_moe=True), moe[1]) == (0, "auto")
    assert "--cpu-moe has no effect" in caplog.text and "no mixture-of-experts layers" in caplog.text


def test_the_launchers_plan_is_the_fit_the_engine_loads(big):
    """#34: the launcher's memory bars and checks (app/launcher/estimate.py, Qt-free) show what --fit places, with
    its reason, not every expert on a GPU too small for them; --n-cpu-moe set by hand is planned as asked."""
    from types import SimpleNamespace

    from app.launcher.estimate import estimate
    from engine.config.loading import load_settings
    from engine.hardware import GpuInfo, HardwareReport

    gpu = GpuInfo(0, "NVIDIA GeForce RTX 4070", (8, 9), "sm_89", 12282, 12000)
    report = HardwareReport(torch_version="2.13.0", cuda_version="12.8", arch_list=[], gpus=[gpu], nvml="ok",
                            ram_total_mib=65536, ram_available_mib=60000, cpu_count=8, cpu_name="Test CPU",
                            verdicts=[], device="cuda:0")
    info = SimpleNamespace(shape=big)
    settings, _ = load_settings(["--weight-dtype", "int4", "--max-concurrency", "1"], {})
    shown = estimate(info, settings, report)
    plan = fit_experts(big, settings, vram_mib=12000, ram_mib=60000)
    assert plan.host_layers and shown.fits, shown.problems
    assert shown.ledger.line("host_experts").bytes == big.expert_bytes("int4", plan.host_layers)
    assert shown.kv_dtype == plan.kv_dtype and shown.context == plan.context
    assert any(plan.why in note and f"{plan.host_layers} of 40 MoE layers" in note for note in shown.notes)
    no_fit, _ = load_settings(["--weight-dtype", "int4", "--max-concurrency", "1", "--no-fit"], {})
    everything = estimate(info, no_fit, report)  # what the launcher showed before
    assert not everything.fits and everything.ledger.line("host_experts") is None
    by_hand, _ = load_settings(["--weight-dtype", "int4", "--max-concurrency", "1", "--n-cpu-moe", "2"], {})
    asked = estimate(info, by_hand, report)
    assert asked.ledger.line("host_experts").bytes == big.expert_bytes("int4", 2)
    assert not any("Fit (" in note for note in asked.notes)
