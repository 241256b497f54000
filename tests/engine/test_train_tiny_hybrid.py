"""scripts/train_tiny_hybrid.py: the checkpoint it trains for the --gdn-state-fp16 drift measurement is a
Qwen3.5-class hybrid (3 GDN : 1 attention) whose training lowered its loss, saved where the engine loads it with
the default model's tokenizer."""
import pytest
import json
import re
import subprocess
import sys
from pathlib import Path

from engine.build import build_engine
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_a_short_training_run_gives_a_hybrid_the_engine_loads(tmp_path):
    text = tmp_path / "text.py"
    text.write_text("def add(a, b):\n    return a + b\n\n\n" * 200)
    out = tmp_path / "hybrid"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tiny_hybrid.py"), str(out), "--text",
                           str(text), "--minutes", "5", "--steps", "8", "--hidden", "128", "--layers", "4", "--seq", "32",
                           "--batch", "4", "--lr", "3e-3"], check=True, cwd=ROOT, capture_output=True, text=True)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert "after 8 steps" in done.stdout
    assert losses and losses[-1] < 10.0  # from ~10.8 (uniform over 49,152 tokens) after 8 steps on repeated text
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    loaded = build_engine(str(out), device="cpu", max_context=256, max_concurrency=1, weight_dtype="fp32",
                          gdn_state_fp16=True)
    try:
        ids = loaded.tokenizer.encode("def add(a, b):")
        tokens = loaded.engine.start().generate(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(tokens) == 4 and all(0 <= t < config["vocab_size"] for t in tokens)
    finally:
        loaded.engine.shutdown()
