"""scripts/gpu_check.sh's CPU parts: the same code at tiny shapes (the numbers are not the point here, the shapes,
the accounting and the report are)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tools import gpu_check, synthetic

ROOT = Path(__file__).resolve().parents[2]
# The project's dependencies other than torch, triton and numpy (by import name): a GPU machine may lack them all.
NOT_NEEDED = ("gguf", "safetensors", "tokenizers", "transformers", "sentencepiece", "jinja2", "llguidance", "fastapi",
              "uvicorn", "pydantic", "httpx", "platformdirs", "psutil", "prometheus_client", "huggingface_hub",
              "PySide6", "qasync", "pyqtgraph")
BLOCKED_RUN = """
import importlib.abc, runpy, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: scripts/gpu_check.sh must run without it")
sys.meta_path.insert(0, Blocked())
sys.argv = [MODULE, *ARGS]
runpy.run_module(MODULE, run_name="__main__")
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(the JSON results, the printed table) of scripts/gpu_check.sh's module at tiny shapes, run once, as the script
    runs it, in a process where every other dependency of the project is unimportable. A subprocess test (the seam
    is the interpreter's imports: no in-process test can show that the check imports none of them)."""
    out = tmp_path_factory.mktemp("gpu-check")
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    module = re.search(r"exec python -m ([\w.]+) ", script).group(1)
    assert module == gpu_check.__name__
    code = (f"BLOCKED = {set(NOT_NEEDED)!r}\nMODULE = {module!r}\n"
            f"ARGS = ['--tiny', '--device', 'cpu', '--skip-tests', '--out', {str(out)!r}]\n" + BLOCKED_RUN)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), run.stdout


@pytest.mark.subprocess
def test_gpu_check_runs_at_tiny_shapes_and_reports_every_section(tiny_run):
    results, table = tiny_run
    assert results["environment"]["device"] == "cpu" and results["tiny"]
    assert results["ceilings"]["copy_gbps"] > 0
    assert {(r["format"], r["layer"]) for r in results["gemv"]} == {
        (f, n) for f in gpu_check.FORMATS for n in ("q_proj", "gate_proj", "down_proj")}
    assert all(r["gbps"] > 0 and r["us"] > 0 for r in results["gemv"])
    assert [(r["format"], r["context"]) for r in results["attention"]] == [
        (f, c) for f in ("float32", "k8v4", "k4v4") for c in (256, 1024)]
    assert all(r["gbps"] > 0 and r["us"] > 0 and r["pct_copy"] > 0 for r in results["attention"])
    mib = {(r["format"], r["context"]): r["kv_mib"] for r in results["attention"]}
    # bytes per token over the 2 KV heads of D 64: K and V codes + fp16 scales (int4: 2 groups of 32)
    per_token = {"float32": 2 * 2 * 64 * 4, "k8v4": 2 * (64 + 2 + 32 + 2 * 2), "k4v4": 2 * 2 * (32 + 2 * 2)}
    assert mib == {(f, c): c * per_token[f] / 2**20 for f, c in mib}  # codes + scales, as docs/KV.md counts them
    for r in results["end_to_end"]:
        assert r["layers"] == r["of_layers"] == gpu_check.TINY.layers
        assert r["decode_tps"] > 0 and r["prefill_tps"] > 0 and 0 < r["pct_roofline"]
        assert r["decode_eager_tps"] > 0 and r["prefill_cublas_tps"] > 0
        # the static decode path (what CUDA graphs capture, called directly here) and the eager one agree
        assert r["decode_path"] == "static decode, no capture" and r["same_tokens"] == r["decode_steps"] > 0
    (h,) = results["hybrid"]
    tiny = gpu_check.TINY_HYBRID
    assert h["layers"] == h["of_layers"] == tiny.layers and [d["context"] for d in h["depths"]] == [128, 256]
    # the state is what the shape says: per GDN layer a conv window and the fp32 delta-rule state
    gdn_layers = tiny.layers - tiny.layers // tiny.interval
    conv_dim = 2 * tiny.k_heads * tiny.head_k + tiny.v_heads * tiny.head_v
    assert h["state_mib_per_sequence"] * 2**20 == gdn_layers * (tiny.v_heads * tiny.head_k * tiny.head_v * 4
                                                                + conv_dim * 3 * 4)
    assert h["kv_bytes_per_token"] == tiny.layers // tiny.interval * 2 * tiny.kv_heads * tiny.head_dim * 4
    for d in h["depths"]:  # the static decode path (what CUDA graphs record) steps the state as the eager one does
        assert d["same_tokens"] == h["decode_steps"] and d["decode_graphs_tps"] > 0 and d["pct_roofline"] > 0
    assert "| hybrid |" in table and "| ternary | 4/4 |" in table
    assert "| GEMV |" in table and "| ternary | 2/2 |" in table and "% roofline" in table
    assert "| attention KV |" in table and "| k8v4 | 1024 |" in table


def test_attention_pages_are_the_kvcache_layout():
    """The benchmark's random quantized pages have the shapes and dtypes a KVCache of that format allocates, and
    the paged attention (the kernel here, under the interpreter) reads them to finite values."""
    import torch

    from engine.memory.kv.cache import KVCache
    from kernels import dispatch

    for fmt in ("k8v4", "k4v4"):
        k, v, ks, vs = gpu_check.kv_pages(fmt, 3, 64, 2, 128, torch.float32, torch.device("cpu"))
        cache = KVCache(1, 3, 2, 128, fmt, torch.device("cpu"))
        for ours, theirs in ((k, cache.k[0]), (v, cache.v[0]), (ks, cache.k_scale[0]), (vs, cache.v_scale[0])):
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, fmt
        out = dispatch.paged_decode_attention(torch.randn(1, 4, 128), k, v, torch.tensor([[2, 0, 1]]),
                                              torch.tensor([150]), k_scale=ks, v_scale=vs)
        assert torch.isfinite(out).all() and out.abs().sum() > 0


def test_synthetic_weights_are_what_the_formats_say():
    import torch

    from kernels.quant import dequantize

    for fmt in gpu_check.FORMATS:
        w = synthetic.random_weight(fmt, 64, 256, torch.device("cpu"))
        dense = dequantize(w)
        assert dense.shape == (64, 256) and torch.isfinite(dense).all() and dense.abs().sum() > 0
        if fmt == "ternary":  # codes 0..2 only: values are -s, 0, +s per group
            scale = w.scales.float().repeat_interleave(64, dim=1)
            assert torch.allclose(dense.abs(), scale * (dense != 0), rtol=1e-3)


def test_device_cuda_without_a_gpu_says_what_to_check(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


@pytest.mark.subprocess
def test_the_script_runs_with_only_torch_triton_and_numpy(tiny_run):
    """scripts/gpu_check.sh's module, run as the script runs it, with every other dependency of the project made
    unimportable: the whole check (at tiny shapes) imports none of them, and writes its table and results."""
    results, table = tiny_run
    assert "| GEMV |" in table and results["environment"]["device"] == "cpu"


@pytest.mark.subprocess
def test_the_kernel_tests_it_runs_import_only_torch_triton_numpy_and_pytest():
    """The kernel test files the check runs on the GPU machine are collected (every module imported) with every
    other dependency of the project made unimportable."""
    blocked = set(NOT_NEEDED)
    code = ("import importlib.abc, sys\n"
            f"BLOCKED = {blocked!r}\n"
            "class Blocked(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in BLOCKED:\n"
            "            raise ImportError(f'{name} is blocked: the GPU check must run without it')\n"
            "sys.meta_path.insert(0, Blocked())\n"
            "import pytest\n"
            f"args = ['--collect-only', *{list(gpu_check.PYTEST_ARGS)!r}, *{list(gpu_check.KERNEL_TESTS)!r}]\n"
            "sys.exit(pytest.main(args))\n")
    # pytest's plugins installed here (pytest-qt imports PySide6) are not on the GPU machine
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"\d{2,} tests collected", run.stdout), run.stdout[-500:]


def test_the_kernel_test_summary_is_pytests_closing_count():
    assert gpu_check.pytest_summary("....\n12 passed, 1 skipped in 3.41s\n") == "12 passed, 1 skipped in 3.41s"
    assert gpu_check.pytest_summary("F.\n===== 1 failed, 1 passed in 0.20s =====\n") == "1 failed, 1 passed in 0.20s"
    collect_error = "ERROR tests/kernels/test_quant.py\n!!! Interrupted: 1 error during collection !!!\n" \
                    "1 error in 0.65s\n"
    assert gpu_check.pytest_summary(collect_error) == "1 error in 0.65s"
    assert gpu_check.pytest_summary("") == "no output"
