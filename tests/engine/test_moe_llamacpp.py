"""qwen35moe GGUF files written by scripts/make_moe_gguf.py (a small shape of it: hidden 128, 4 layers of 3 GDN : 1
gated attention, 16 experts of width 32, top 4, a shared expert) run by NInfer as llama.cpp runs them, with
llama-cpp-python as the oracle (skipped where it is not installed: docs/BENCHMARKS.md, Peers). NInfer loads them as
`--weight-dtype auto` does (the file's own Q8_0/Q4_0 blocks, the router and shared gate float32); llama.cpp keeps
its KV in float32 (type_k = type_v = 0). Both decode greedily one token at a time after the prompt (its prefill in
chunks on NInfer's side); each decode step's logits are compared, with llama.cpp's tokens fed to both.

F32: the same arithmetic up to float rounding, so the logits agree to ~1e-6 and the greedy tokens of the two engines,
each decoding on its own, are the same 32 of 32. Q8_0 / Q4_0: each engine rounds the activations its own way for
its low-bit kernels (llama.cpp to Q8_0 blocks, NInfer to int16 blocks or bfloat16 in prefill), which moves the
logits by ~1-4 % of their norm on this random model; the greedy token is the same wherever llama.cpp's choice is not
a near tie. A routing mistake (a wrong expert picked, the top-k weights not renormalised, a shared expert left out)
moves the logits by tens of percent.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.build import build_engine
from engine.memory.state import SeqState
from engine.runner import Work
from engine.sampling import SamplingParams
from tests.engine.helpers import run_concurrently

ROOT = Path(__file__).resolve().parents[2]
STEPS = 32


def _script():
    spec = importlib.util.spec_from_file_location("make_moe_gguf", ROOT / "scripts" / "make_moe_gguf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_moe_gguf", module)
    spec.loader.exec_module(module)
    return module


make = _script()
SHAPE = make.MoEShape(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, gdn_k_heads=2, gdn_v_heads=4,
                      gdn_head_dim=32, experts=16, experts_used=4, expert_width=32, shared_width=64)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-llamacpp")
    return {t: make.write_moe_gguf(folder / f"moe-{t}.gguf", SHAPE, t, seed=0) for t in ("F32", "Q8_0", "Q4_0")}


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, 49152, n)]


def llama(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e \".[peers]\"")
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=512,
                           logits_all=True, type_k=0, type_v=0, verbose=False)


def llama_greedy(llm, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy tokens after `ids`, one decode call a token, and the logits each was picked from."""
    llm.reset()
    llm.eval(ids)
    tokens, rows = [], []
    for _ in range(steps):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        rows.append(row)
        tokens.append(int(row.argmax()))
        llm.eval([tokens[-1]])
    return tokens, np.stack(rows)


def ninfer_forced(runner, ids: list[int], tokens: list[int], chunk: int = 48) -> np.ndarray:
    """NInfer's logits after `ids` (prefilled in chunks of `chunk`) and after each of `tokens` but the last, fed one
    decode step at a time: the rows llama_greedy returns."""
    pages = runner.pool.allocate(-(-(len(ids) + len(tokens)) // runner.page_size))
    state = SeqState(runner.state.allocate())
    try:
        for start in range(0, len(ids), chunk):
            row = runner.run([Work(ids[start:start + chunk], start, pages, "last", state)])[0]
        rows = [row]
        for i, t in enumerate(tokens[:-1]):
            rows.append(runner.run([Work([t], len(ids) + i, pages, "last", state)])[0])
        return torch.cat([r.reshape(1, -1) for r in rows]).float().numpy()
    finally:
        runner.state.free([state.slot])
        runner.pool.deallocate(list(pages))


def engine(path: Path):
    return build_engine(path, device="cpu", weight_dtype="auto", kv_dtype="fp32", max_concurrency=1,
                        max_context=256)


def rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def test_the_files_are_what_the_script_says(files):
    from engine.model.loader import load_weights

    _, weights = load_weights(files["Q4_0"], native=True)
    cfg = weights.config
    assert cfg.moe.num_experts == 16 and cfg.moe.top_k == 4 and cfg.hidden_size == 128
    assert cfg.layer_kinds == ("recurrent",) * 3 + ("attention",)
    storage = weights.storage
    assert storage["model.layers.1.mlp.experts.15.down_proj.weight"] == "Q4_0 -> int4"
    assert storage["model.layers.3.self_attn.q_proj.weight"] == "Q4_0 -> int4"
    assert weights.tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32


def test_f32_greedy_tokens_and_logits_are_llama_cpp_s(files):
    path, ids = files["F32"], prompt(1, 70)
    expected, ref = llama_greedy(llama(path), ids, STEPS)
    loaded = engine(path)
    try:
        ours = ninfer_forced(loaded.engine.runner, ids, expected)
        out = run_concurrently(loaded.engine.start(), [ids],
                               [SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)])[0][0]
    finally:
        loaded.engine.shutdown()
    assert rel(ours, ref).max() < 1e-5
    assert out == expected


@pytest.mark.parametrize("qtype, bound", [("Q8_0", 0.08), ("Q4_0", 0.08)])
def test_low_bit_greedy_tokens_are_llama_cpp_s_but_near_ties(files, qtype, bound):
    path, ids = files[qtype], prompt(2, 70)
    expected, ref = llama_greedy(llama(path), ids, STEPS)
    loaded = engine(path)
    try:
        assert loaded.engine.runner.model.weight_format == {"Q8_0": "int8", "Q4_0": "int4"}[qtype]
        ours = ninfer_forced(loaded.engine.runner, ids, expected)
    finally:
        loaded.engine.shutdown()
    errors = rel(ours, ref)
    assert errors.max() < bound, errors
    picked = ours.argmax(-1)
    agree = picked == np.array(expected)
    # where NInfer picks another token, it is a near tie in llama.cpp's own logits: the two tokens' logits lie
    # closer than 4x the row's rms difference between the engines
    margin = ref.max(-1) - ref[np.arange(STEPS), picked]
    noise = np.sqrt(((ours - ref) ** 2).mean(-1))
    assert agree.sum() >= STEPS - 2 and (margin < 4 * noise)[~agree].all(), (agree, margin / noise)
