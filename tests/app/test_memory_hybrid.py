"""The launcher's memory plan for a Gated-DeltaNet hybrid (a Qwen3.5-27B-shaped config.json, the published
Qwen3_5ForConditionalGeneration layout): the recurrent state is a segment of its own in the bars and the legend, the
ledger's state line, with the conv window in the dtype the engine keeps it in on that device."""
from __future__ import annotations

import json

import pytest

from app.launcher.estimate import estimate, model_info
from tests.app.test_memory import _CPU, _GPU, _settings
from tests.engine.test_ledger_hybrid import QWEN35_27B_TEXT


@pytest.fixture
def qwen27(tmp_path):
    folder = tmp_path / "Qwen3.5-27B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                    "text_config": QWEN35_27B_TEXT}))
    return model_info(folder)


def test_the_state_line_is_a_segment_of_its_own(qwen27, qapp):
    from app.launcher.memory_bar import MemoryBar
    from engine.ledger import build_ledger
    from engine.memory.geometry import state_slots

    settings = _settings(weight_dtype="ternary", kv_dtype="k8v4", max_context=8192, max_concurrency=1)
    mem = estimate(qwen27, settings, _GPU(12288, 11000))
    ledger = build_ledger(qwen27.shape.on_device(True, "ternary"), settings, vram_mib=11000, ram_mib=8192)
    slots = state_slots(1)  # the sequence's slot on the GPU; its prefix snapshot is in host memory
    assert mem.state == ledger.line("state").bytes == slots * qwen27.shape.on_device(True).state_bytes() > 0
    vram = {s.key: s for s in mem.bars()[0].segments}
    assert list(vram) == ["weights", "kv", "state", "other", "headroom"]
    assert vram["state"].label == "recurrent state" and vram["state"].bytes == mem.state
    assert vram["other"].bytes == ledger.line("activations").bytes  # the workspace no longer holds the state
    ram = {s.key: s for s in mem.bars()[1].segments}  # the prefix snapshot, in host memory
    assert ram["state"].label == "state snapshots" and ram["state"].bytes == ledger.line("state_snapshots").bytes > 0
    assert [bar.planned for bar in mem.bars()] == [ledger.total("gpu"), ledger.total("host")]
    w = MemoryBar()
    w.resize(500, 200)
    w.show()
    w.set_estimate(mem)
    assert f"recurrent state {mem.state / 2**20:,.0f} MiB" in w.legend_text()
    assert any(key == "state" for key, _, _ in w.rows[0][1].spans())
    w.close()

    cpu = estimate(qwen27, _settings(max_context=8192, max_concurrency=1), _CPU())  # fp32 activations on the CPU
    assert cpu.state == slots * qwen27.shape.on_device(False).state_bytes() > mem.state
