"""The machine a benchmark ran on: its facts, a reference read bandwidth, and how busy other processes kept it."""
from __future__ import annotations

import os
import statistics
import time

import psutil
import torch

from engine.hardware import _cpu_name


def measure_bandwidth(device: torch.device, rows: int = 49152, cols: int = 576, repeat: int = 20) -> float:
    """Reference read bandwidth in GB/s: a vector times a rows x cols fp32 matrix (F.linear), median time."""
    w = torch.randn(rows, cols, device=device)
    x = torch.randn(1, cols, device=device)
    times = []
    for _ in range(repeat + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return w.numel() * w.element_size() / statistics.median(times[2:]) / 1e9


class LoadMeter:
    """CPU time other processes used while the benchmark ran, in cores (0.0 on an otherwise idle machine); the
    benchmark's own child processes are not other processes."""

    def __enter__(self):
        self._me = psutil.Process()
        self._start = (self._busy(psutil.cpu_times()), self._own(), time.perf_counter())
        return self

    def __exit__(self, *exc):
        busy, own, t0 = self._start
        self.own_seconds = self._own() - own  # CPU time of the benchmark itself and its finished children
        other = (self._busy(psutil.cpu_times()) - busy) - self.own_seconds
        self.cores = max(other, 0.0) / (time.perf_counter() - t0)

    @staticmethod
    def _busy(t) -> float:
        return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    def _own(self) -> float:
        """This process's CPU time and its finished children's (a peer measured in a child process of its own)."""
        t = self._me.cpu_times()
        return t.user + t.system + t.children_user + t.children_system


def machine_facts(loaded, threads: int) -> dict:
    device = loaded.device
    return {
        "cpu": _cpu_name(),
        "cores": f"{psutil.cpu_count(logical=False)} physical, {os.cpu_count()} logical",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": threads,
        "dtype": str(loaded.dtype).removeprefix("torch.") + " (transformers and NInfer's activations)",
        "ninfer weights": loaded.engine.runner.model.weight_format,
        "ninfer KV": str(loaded.engine.runner.kv.kv_dtype).removeprefix("torch."),
        "model": f"{loaded.path.name} ({loaded.config.name or loaded.config.arch})",
        "weight bytes": loaded.engine.runner.model.weight_bytes(),
        "measured memory bandwidth": f"{measure_bandwidth(device):.2f} GB/s (F.linear, 1x576 by 49152x576 fp32)",
    }
