"""scripts/make_bench_gguf.py: the second model of the llama.cpp comparison is a GGUF the engine loads with the
types the script says (Q4_0 / Q8_0 / Q5_0 layers, a Q8_0 tied embedding), the default model's tokenizer, and
decodes through the C++ step."""
import pytest
import subprocess
import sys
from pathlib import Path

import torch

from engine.build import build_engine
from engine.model.default import default_model_path
from engine.model.loader import load_weights
from engine.runner import Work
from engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_the_bench_gguf_loads_as_written(tmp_path):
    out = tmp_path / "bench.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_bench_gguf.py"), str(out), "--hidden", "128",
                    "--layers", "4", "--heads", "2", "--kv-heads", "1", "--intermediate", "256"], check=True,
                   cwd=ROOT)
    _, weights = load_weights(out, native=True)
    cfg = weights.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == \
        (128, 4, 2, 1, 256)
    storage = weights.storage
    assert storage["model.layers.0.self_attn.q_proj.weight"] == "Q4_0 -> int4"
    assert storage["model.layers.0.self_attn.v_proj.weight"] == "Q8_0 -> int8"
    assert storage["model.layers.0.mlp.down_proj.weight"] == "Q8_0 -> int8"
    assert storage["model.layers.3.mlp.down_proj.weight"] == "Q5_0 -> int8"  # every fourth layer's down
    le = build_engine(out, weight_dtype="auto", max_concurrency=1, max_context=256)
    text = "The quick brown fox"
    assert le.tokenizer.encode(text) == Tokenizer.from_gguf(default_model_path()).encode(text)
    runner = le.engine.runner
    pages = runner.pool.allocate(1)
    runner.run([Work([5, 6, 7], 0, pages)])
    logits = runner.run([Work([8], 3, pages)])[0]
    assert runner.graphs.fused is not None and runner.graphs.fused.steps == 1
    assert torch.isfinite(logits).all()
