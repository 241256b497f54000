"""Kernel tests run every Triton kernel on the CPU through the Triton interpreter.

triton.jit decides interpreted-or-compiled when a kernel is *defined*, so TRITON_INTERPRET=1 is set here, before any
kernels.* module with @triton.jit is imported (modules imported earlier are reloaded). The variable is then put back
as it was, so that the rest of a combined `pytest tests` session (which collects this file before running anything)
does not route the engine's CPU work through the interpreter via kernels.dispatch.use_triton; the autouse fixture
below sets it again for each kernel test.

Seeds: every test draws random inputs from its own seed (a hash of the test's id, so CI runs are repeatable);
set NINFER_TEST_SEED=random for new inputs on every run, or to a number to replay one (the seed is printed with a
failing test's captured output).
"""
import os
import zlib
import sys

# NINFER_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs the same tests compiled for the GPU: tensors are created on
# CUDA by default and the interpreter stays off.
DEVICE = os.environ.get("NINFER_TEST_DEVICE", "cpu")
_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

TRITON_MODULES = ("kernels.qlinear", "kernels.paged_attention", "kernels.rms_norm", "kernels.rope",
                  "kernels.silu_and_mul", "kernels.kv_write", "kernels.quest", "kernels.gated_delta",
                  "kernels.gated_delta_chunk", "kernels.moe")  # kernels.moe after kernels.qlinear, whose tiles it calls
for _name in TRITON_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
    else:
        importlib.import_module(_name)

if _SAVED_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


@pytest.fixture(autouse=True)
def _interpret_and_seed(monkeypatch, request):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        torch.set_default_device(DEVICE)
        request.addfinalizer(lambda: torch.set_default_device(None))
    monkeypatch.delenv("NINFER_NO_TRITON", raising=False)
    wanted = os.environ.get("NINFER_TEST_SEED", "")
    if wanted == "random":
        seed = int.from_bytes(os.urandom(4), "little")
    else:
        seed = int(wanted) if wanted else zlib.crc32(request.node.nodeid.encode())
    print(f"NINFER_TEST_SEED={seed}")
    torch.manual_seed(seed)
    yield
