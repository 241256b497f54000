"""The machine a benchmark ran on: its facts, its read bandwidth (the decode roofline), and how busy other processes
kept it."""
from __future__ import annotations

import glob
import os
import statistics
import time

import psutil
import torch

from engine.hardware import _cpu_name

MIB = 1 << 20
STREAM_MIN_BYTES = 256 * MIB  # never a smaller buffer, whatever the cache says
STREAM_MAX_BYTES = 4 << 30  # never a larger one (nor more than a quarter of the memory available)
STREAM_LLC_TIMES = 4  # the buffer is this many times the last-level cache


def measure_bandwidth(device: torch.device, rows: int = 49152, cols: int = 576, repeat: int = 20) -> float:
    """A GEMV's read rate in GB/s: a vector times a rows x cols fp32 matrix (F.linear), median time. Not a stream
    read (the matrix, 113 MB, may sit in a large cache): the roofline is `measure_read_bandwidth`."""
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


def _size(text: str) -> int:
    """'491520K', '2048K', '32M' (sysfs cache sizes) -> bytes."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG") or 0) * mult


def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Bytes of the CPU's last-level cache (the highest level sysfs lists for cpu0), or None where sysfs has none."""
    best = None
    for folder in glob.glob(os.path.join(root, "index*")):
        try:
            with open(os.path.join(folder, "level")) as f:
                level = int(f.read())
            with open(os.path.join(folder, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(folder, "size")) as f:
                size = _size(f.read())
        except (OSError, ValueError):
            continue
        if size and (best is None or level > best[0]):
            best = (level, size)
    return best[1] if best else None


def stream_bytes(llc: int | None, available: int) -> int:
    """The stream buffer: STREAM_LLC_TIMES x the last-level cache, at least STREAM_MIN_BYTES, at most
    STREAM_MAX_BYTES and a quarter of the available memory; a whole number of MiB."""
    want = max(STREAM_LLC_TIMES * (llc or 0), STREAM_MIN_BYTES)
    return max(min(want, STREAM_MAX_BYTES, available // 4) // MIB, 1) * MIB


def measure_read_bandwidth(device: torch.device, nbytes: int | None = None, repeat: int = 7,
                           threads: int | None = None) -> dict:
    """The roofline of decode: a stream read (a float32 sum) of a buffer several times the last-level cache on
    `threads` threads (default: one per physical core, whatever the benchmark ran on), the median of `repeat` passes
    after one warm-up pass. Returns gbps, bytes, llc (bytes or None), threads and every pass's GB/s."""
    before = torch.get_num_threads()
    threads = threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    torch.set_num_threads(threads)
    try:
        return _stream(device, nbytes, repeat)
    finally:
        torch.set_num_threads(before)


def _stream(device: torch.device, nbytes: int | None, repeat: int) -> dict:
    if device.type == "cuda":
        llc = torch.cuda.get_device_properties(device).L2_cache_size
        nbytes = nbytes or max(STREAM_LLC_TIMES * llc, 1 << 30)
    else:
        llc = last_level_cache()
        nbytes = nbytes or stream_bytes(llc, psutil.virtual_memory().available)
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # written once: every page is mapped
    rates = []
    for i in range(repeat + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        total = buf.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if i:  # pass 0 is the warm-up
            rates.append(buf.numel() * 4 / seconds / 1e9)
    if abs(float(total) - buf.numel()) > 1e-3 * buf.numel():  # the sum ran over every element
        raise RuntimeError(f"the stream read summed {float(total)} where {buf.numel()} was expected: the bandwidth "
                           "measurement is wrong; report this with the output of lscpu")
    del buf
    return dict(gbps=statistics.median(rates), bytes=nbytes, llc=llc, threads=torch.get_num_threads(),
                passes=rates)


def describe_stream(stream: dict) -> str:
    llc = f"{stream['llc'] / MIB:.0f} MiB last-level cache" if stream.get("llc") else "last-level cache unknown"
    return (f"{stream['gbps']:.2f} GB/s (float32 sum of {stream['bytes'] / MIB:.0f} MiB, {llc}, "
            f"{stream['threads']} threads, median of {len(stream['passes'])})")


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


def machine_facts(loaded, threads: int, stream: dict | None = None) -> dict:
    """The facts the table heads: `stream` is measure_read_bandwidth's result (measured here when not given)."""
    device = loaded.device
    stream = stream or measure_read_bandwidth(device)
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
        "stream read bandwidth": describe_stream(stream),
        "measured memory bandwidth": f"{measure_bandwidth(device):.2f} GB/s (F.linear, 1x576 by 49152x576 fp32)",
    }
