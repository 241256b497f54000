"""After the weights are read, loading reports what it does (the launcher shows it instead of a silent minute): the
weights prepared for the device, the C++ decode kernels compiled where they are not loaded yet, the self-check, the
KV cache and the engine."""
from __future__ import annotations

import pytest

from engine.build import WARMUP, build_engine
from kernels import cpu_native


def test_built_says_whether_the_kernel_cache_holds_this_cpus_build(tmp_path, monkeypatch):
    assert cpu_native.ready() is None  # built (or loaded from the cache) in this session
    assert cpu_native.built()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # another, empty kernel cache
    assert not cpu_native.built()


@pytest.mark.parametrize("cached", [False, True], ids=["first start", "built before"])
def test_the_warm_up_reports_each_phase(monkeypatch, cached):
    seen: list[tuple[float, str]] = []
    monkeypatch.setattr(cpu_native, "loaded", lambda: False)  # a new process: nothing loaded in it yet
    monkeypatch.setattr(cpu_native, "built", lambda: cached)  # ... and the kernel cache with or without the build
    loaded = build_engine(None, device="cpu", max_context=256, max_concurrency=1,
                          progress=lambda fraction, message: seen.append((fraction, message)))
    try:
        phases = [m.removeprefix(WARMUP) for f, m in seen if m.startswith(WARMUP)]
        assert phases[0] == "preparing the weights for the CPU"
        assert phases[1] == "loading the C++ decode kernels built for this CPU" if cached else \
            phases[1].startswith("compiling the C++ decode kernels for this CPU")
        assert phases[2:] == ["checking the converted weights", "sizing the KV cache and building the engine"]
        assert all(f == 1.0 for f, m in seen if m.startswith(WARMUP))  # the weights are in by then
        first = next(i for i, (_, m) in enumerate(seen) if m.startswith(WARMUP))
        assert first > 0 and not any(m.startswith(WARMUP) for _, m in seen[:first])  # after every tensor
    finally:
        loaded.engine.shutdown()
