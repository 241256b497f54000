"""Every Triton kernel compiles for sm_80 and sm_90 (no GPU needed) with the launch parameters its wrapper uses on a
GPU, and spills no registers. Runs tests/kernels/cuda_compile_check.py in a fresh process without TRITON_INTERPRET
(the kernels in this process were defined for the interpreter)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_kernels_compile_for_cuda_without_spills():
    try:
        import triton.backends.nvidia  # noqa: F401
    except Exception:
        pytest.skip("triton has no NVIDIA backend here")
    if not (Path(sys.modules["triton"].__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.kernels.cuda_compile_check", "80", "90"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) > 50
    gated_delta = {row["kernel"].split()[0] for row in rows if row["kernel"].startswith(("gdn_", "causal_conv"))}
    assert gated_delta == {"gdn_recurrent", "gdn_chunked", "causal_conv_update"}, gated_delta
    assert {row["kernel"].split()[1] for row in rows if row["kernel"].startswith("fused_moe")} == \
        {"gate_up_kernel", "down_kernel"}
    failed = [row for row in rows if not row["ok"]]
    assert not failed, failed[:3]
    spilled = [f"sm_{row['arch']} {row['kernel']}: {row['spill_bytes']} bytes" for row in rows if row["spill_bytes"]]
    assert not spilled, spilled
