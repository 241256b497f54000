"""Where compiled CPU kernels are kept: inductor's artifacts and the C++ unit of kernels/cpu_native.py, in the user's
cache folder (`platformdirs.user_cache_dir("ninfer")/compiled`), kept across starts, reboots and NINFER_HOME folders.

Every build there is named by what made it (inductor's own keys; the C++ unit's hash of its sources, flags, torch's
version and the CPU's features, `cpu_native.build_key`), so one folder serves every process, test run and checkout
of a user without ever loading a build made from other sources or for another CPU. TORCHINDUCTOR_CACHE_DIR, where
set, wins (the C++ unit then goes beside it)."""
from __future__ import annotations

import os


def kernel_cache_root() -> str:
    from platformdirs import user_cache_dir

    return os.path.join(user_cache_dir("ninfer", appauthor=False), "compiled")


def use_kernel_cache() -> str:
    """Points TORCHINDUCTOR_CACHE_DIR (read by inductor and by kernels/cpu_native.build_dir) at the kernel cache,
    unless it is set already; returns it."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(kernel_cache_root(), "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
