"""The launcher's memory plan is the engine's memory ledger: the same lines, the same KV bytes per token for the
quantized KV formats as the engine allocates, grouped into the VRAM and RAM bars the launcher draws."""
from __future__ import annotations

import dataclasses

import pytest

from app.launcher.estimate import MIB, estimate, model_info
from app.launcher.settings import defaults, effective
from app.launcher.validation import validate


class _CPU:
    verdicts: list = []
    gpus: list = []
    device = "cpu"
    nvml = "no NVIDIA GPU"
    ram_total_mib = 16384
    ram_available_mib = 8192

    def usable_gpu(self):
        return None


class _GPUInfo:
    def __init__(self, total: int, free: int):
        self.vram_total_mib, self.vram_free_mib = total, free


class _GPU(_CPU):
    def __init__(self, total: int = 12288, free: int = 11000):
        self.gpu = _GPUInfo(total, free)

    def usable_gpu(self):
        return self.gpu


def _settings(**values):
    form = defaults()
    form.update(max_context=1024, max_concurrency=2)
    form.update(values)
    eff = effective(form, None, None, env={})
    assert eff.settings is not None, eff.problems
    return eff.settings


@pytest.mark.parametrize("kv_dtype", ["k8v4", "rk4v4", "k8v8"])
def test_quantized_kv_estimate_equals_the_ledger_and_the_engine(kv_dtype):
    import torch

    from engine.memory.kv.cache import KVCache
    from engine.ledger import KV_LAYOUTS, ModelShape, build_ledger

    info = model_info(None)
    cfg = info.config
    settings = _settings(kv_dtype=kv_dtype)
    mem = estimate(info, settings, _CPU())
    ledger = build_ledger(ModelShape.from_path(None), settings, vram_mib=0, ram_mib=8192)

    engine_bpt = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, kv_dtype, torch.device("cpu")).token_bytes
    assert mem.kv_bytes_per_token == ledger.page_bytes // 64 == engine_bpt
    assert mem.kv_bytes_per_token == KV_LAYOUTS[kv_dtype].bytes_per_token(cfg.num_layers, cfg.num_kv_heads,
                                                                          cfg.head_dim)
    fp32 = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 4
    assert mem.kv_bytes_per_token < fp32 / 3  # 4-bit and 8-bit codes with fp16 scales, not 4 bytes a value
    assert mem.kv_tokens == ledger.kv_capacity_tokens == 2 * 1024  # both sequences at full context
    assert mem.kv == ledger.line("kv").bytes == 2048 * engine_bpt
    assert mem.weights == ledger.line("weights").bytes == info.shape.stored_bytes
    assert mem.kv_dtype == kv_dtype and mem.fits
    (bar,) = mem.bars()  # no GPU: one RAM bar holds every line
    assert bar.title == "RAM" and bar.budget == 8192 * MIB and bar.capacity == 16384 * MIB
    assert bar.others == (16384 - 8192) * MIB
    assert bar.planned == ledger.total("host")
    assert {s.key: s.bytes for s in bar.segments}["kv"] == mem.kv


def test_gpu_bar_and_host_kv_bar():
    from engine.ledger import ModelShape, build_ledger

    info = model_info(None)
    settings = dataclasses.replace(_settings(kv_dtype="k8v4"), host_kv_mib=512, kv_headroom_mib=512)
    mem = estimate(info, settings, _GPU(12288, 11000))
    ledger = build_ledger(ModelShape.from_path(None), settings, vram_mib=11000, ram_mib=8192)
    vram, ram = mem.bars()
    assert (vram.title, ram.title) == ("VRAM", "RAM") and mem.device == "cuda"
    assert vram.capacity == 12288 * MIB and vram.others == (12288 - 11000) * MIB and vram.budget == 11000 * MIB
    gpu = {s.key: s for s in vram.segments}
    assert list(gpu) == ["weights", "kv", "other", "headroom"]
    assert gpu["kv"].label == "KV GPU" and gpu["kv"].bytes == ledger.line("kv").bytes
    assert gpu["headroom"].bytes == 512 * MIB and gpu["headroom"].reserved
    assert vram.planned == ledger.total("gpu") and not vram.over
    host = {s.key: s for s in ram.segments}
    assert host["host_kv"].bytes == ledger.line("host_kv").bytes == (512 * MIB // ledger.page_bytes) * ledger.page_bytes
    assert ram.planned == ledger.total("host")


def test_a_plan_that_does_not_fit_is_an_error_naming_the_line():
    info = model_info(None)
    settings = dataclasses.replace(_settings(), kv_capacity=1024 * 64)  # 64K tokens of fp32 KV on a tiny GPU
    mem = estimate(info, settings, _GPU(2048, 1500))
    (vram, _ram) = mem.bars()
    assert vram.over > 0 and not mem.fits
    level, message, remedy = mem.problems[0]
    assert level == "error" and "KV pages line" in message and "--kv-capacity" in remedy

    form = defaults()
    form.update(max_context=1024, max_concurrency=2, kv_capacity=65536)
    v = validate(form, None, None, _GPU(2048, 1500), env={}, info=info, check_port=False)
    assert not v.ok and any(c.area == "memory" and "KV pages line" in c.message for c in v.errors)


def test_memory_bar_widget_draws_the_ledger(qapp):
    from app.launcher.memory_bar import MemoryBar

    info = model_info(None)
    settings = dataclasses.replace(_settings(kv_dtype="k8v4"), host_kv_mib=512)
    mem = estimate(info, settings, _GPU(12288, 11000))
    w = MemoryBar()
    w.resize(500, 200)
    w.show()
    w.set_estimate(mem)
    title0, bar0, legend0 = w.rows[0]
    title1, bar1, legend1 = w.rows[1]
    assert bar0.isVisibleTo(w) and bar1.isVisibleTo(w)
    text = w.legend_text()
    assert "KV GPU" in text and "host KV" in text and "weights" in text and "other programs" in text
    assert "VRAM" in title0.text() and "11,000 of 12,288 MiB free" in title0.text()
    spans = {key: (x, width) for key, x, width in bar0.spans()}
    assert spans["others"][1] == pytest.approx((12288 - 11000) / 12288)
    assert spans["weights"][1] == pytest.approx(mem.weights / (12288 * MIB))
    assert spans["weights"][0] == pytest.approx(spans["others"][1])  # stacked after what others use
    assert f"{mem.kv_bytes_per_token:,} B (k8v4)" in w.footer.text()
    assert not w.grab().isNull()

    cpu = estimate(info, _settings(), _CPU())
    w.set_estimate(cpu)
    assert w.rows[0][1].isVisibleTo(w) and not w.rows[1][1].isVisibleTo(w) and "RAM" in w.rows[0][0].text()
    tight = estimate(info, dataclasses.replace(_settings(), kv_capacity=65536), _GPU(2048, 1500))
    w.set_estimate(tight)
    assert "MiB over" in w.rows[0][0].text()
    w.set_estimate(None)
    assert not w.rows[0][1].isVisibleTo(w) and "Shown once" in w.footer.text()
    w.close()


def test_a_hugging_face_folder_is_planned_from_its_headers(tmp_path):
    """An HF folder (config.json + safetensors) with a non-ASCII name: read without loading, planned by the ledger."""
    from engine.ledger import ModelShape, build_ledger
    from tests.engine.helpers import tiny_hf_model

    _, folder = tiny_hf_model("llama", tmp_path, name="模型 ünï")
    info = model_info(folder)
    assert info.kind == "hf" and info.config.num_layers == 2 and info.params > 0
    form = defaults()
    form.update(max_context=1024, max_concurrency=1, kv_dtype="k4v4")
    v = validate(form, str(folder), None, _CPU(), env={}, info=info, check_port=False)
    assert v.ok, v.errors
    ledger = build_ledger(ModelShape.from_path(folder), v.settings, vram_mib=0, ram_mib=8192)
    stored = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert v.memory.weights == ledger.line("weights").bytes and 0 < v.memory.weights <= stored
    assert v.memory.kv_bytes_per_token == ledger.page_bytes // 64 and v.memory.kv_tokens == 1024
    assert any(c.area == "model" and c.level == "ok" and "2 layers" in c.message for c in v.checks)
