import os

# Nothing in the tests may reach a model hub; kernels run under the Triton interpreter on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Nothing in the tests writes into the user's NInfer folders (settings, data such as the library's last use).
if not os.environ.get("NINFER_HOME"):
    import tempfile

    os.environ["NINFER_HOME"] = tempfile.mkdtemp(prefix="ninfer-tests-home-")
# Compiled CPU kernels (inductor's and the C++ unit, engine/kernel_cache.py) come from the user's kernel cache, shared
# by this run, the processes it starts and later runs: each build is keyed by what made it, so it is made once per
# machine and source, not once per run.
from engine.kernel_cache import use_kernel_cache  # noqa: E402

use_kernel_cache()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def cpp_kernels():
    """The C++ CPU kernels (kernels/cpu_native.py), built or loaded from the kernel cache on first use, never at
    collection. The project's dependencies bring what they need (a C++ compiler, ninja): not building is a failure."""
    from kernels import cpu_native

    why = cpu_native.ready()
    assert why is None, why
