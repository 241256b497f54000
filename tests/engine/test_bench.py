"""ninfer-bench runs end to end and reports every metric; no timing assertions (benchmarks are not timed tests)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tools.bench.cli import main
from engine.tools.bench.measure import METRICS, build_prompt, decode_bytes_per_token, ratios

KEYS = [key for key, *_ in METRICS]


def _tiny_llama_folder(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from engine.tools.bench.measure import FILLER

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rust.train_from_iterator([FILLER], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    tok.save_pretrained(str(folder))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


def _check_column(result: dict, name: str) -> None:
    column = result[name]
    for key in KEYS:
        assert column[key] > 0, (name, key)
    assert column["weight_bytes"] > 0
    assert len(column["tokens"]) == result["gen_tokens"]


@pytest.mark.slow
def test_bench_default_model_no_compare(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--prompt-tokens", "32", "--gen-tokens", "8", "--repeat", "1", "--compare", "none", "--threads", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    _check_column(result, "ninfer")
    assert result["peer"] is None and result["ratio"] is None and "transformers" not in result
    assert result["ninfer"]["prefix_hit_tokens"] == 0  # every run prefilled the whole prompt
    assert "measured memory bandwidth" in result["machine"]
    text = capsys.readouterr().out
    assert "| metric" in text and "decode tok/s" in text and "TTFT (ms)" in text and "weight bytes" in text


def test_bench_compare_transformers_tiny_folder(tmp_path, capsys):
    folder = _tiny_llama_folder(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    assert main([str(folder), "--prompt-tokens", "24", "--gen-tokens", "6", "--repeat", "1", "--threads", "1",
                 "--device", "cpu", "--compare", "transformers", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    _check_column(result, "ninfer")
    _check_column(result, "transformers")
    assert result["peer"] == "transformers"
    assert result["ninfer"]["weight_bytes"] == result["transformers"]["weight_bytes"]
    assert set(result["ratio"]) == set(KEYS) and all(r > 0 for r in result["ratio"].values())
    text = capsys.readouterr().out
    assert "transformers" in text and "greedy outputs agree" in text
    row = next(line for line in text.splitlines() if line.startswith("| decode tok/s"))
    assert row.count("-") == 0  # both columns and the ratio are filled
    # 2 runs (warm-up + 1) x 5 steps, each one C++ call: the float32 linears are read by the C++ GEMV
    assert result["machine"]["decode steps"] == "10, 10 of them as one C++ call (kernels/cpu_decode.cpp)"
    assert result["machine"]["ninfer KV"] == "fp32"  # transformers' cache is --dtype: so is NInfer's


def test_bench_says_its_decode_steps_ran_as_the_compiled_step(tmp_path, capsys):
    """--cpu-compile step: the table says how many decode steps the compiled graph ran (all of them here), so a
    run where it fell back to eager cannot pass for a measurement of it."""
    folder = _tiny_llama_folder(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    assert main([str(folder), "--prompt-tokens", "24", "--gen-tokens", "6", "--repeat", "1", "--threads", "1",
                 "--device", "cpu", "--compare", "none", "--cpu-compile", "step", "--json", str(out)]) == 0
    steps = json.loads(out.read_text())["machine"]["decode steps"]
    assert steps == "10, 10 of them as one compiled graph (--cpu-compile step)"
    assert steps in capsys.readouterr().out


def test_helpers():
    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

    assert len(build_prompt(Tok(), 5000)) == 5000
    assert decode_bytes_per_token(1000, 10, 100, 20) == 1000 + 10 * 110
    r = ratios(dict(ttft_s=1.0, prefill_tps=10, decode_tps=4, decode_gbps=2),
               dict(ttft_s=2.0, prefill_tps=5, decode_tps=2, decode_gbps=1))
    assert r == dict(ttft_s=2.0, prefill_tps=2.0, decode_tps=2.0, decode_gbps=2.0)


def test_kv_dtype_follows_the_peer_unless_given():
    from argparse import Namespace

    from engine.tools.bench.cli import kv_dtype

    assert kv_dtype(Namespace(kv_dtype="same", compare="llama.cpp", dtype="fp32")) == "fp16"
    assert kv_dtype(Namespace(kv_dtype="same", compare="transformers", dtype="bf16")) == "bf16"
    assert kv_dtype(Namespace(kv_dtype="same", compare="none", dtype="fp32")) == "fp32"
    assert kv_dtype(Namespace(kv_dtype="fp32", compare="llama.cpp", dtype="fp32")) == "fp32"


def test_bad_arguments():
    assert main(["--gen-tokens", "1", "--compare", "none"]) == 2


def test_bench_via_api_compares_http_with_engine_direct(tmp_path, capsys):
    import json

    from engine.tools.bench.cli import main
    out = tmp_path / "api.json"
    assert main(["--prompt-tokens", "24", "--gen-tokens", "6", "--repeat", "1", "--compare", "none", "--via-api",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    api = result["via_api"]
    assert api["decode_tps"] > 0 and api["ttft_s"] > 0
    assert len(api["tokens"]) == len(result["ninfer"]["tokens"]) == 6
    assert "API/direct" in capsys.readouterr().out
