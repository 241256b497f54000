"""What hardware the engine can use, and what to do when it cannot use the GPU.

``probe()`` inspects PyTorch, NVML, host RAM and the CPU and returns a :class:`HardwareReport` whose
verdicts say what is wrong and how to fix it; ``resolve_device()`` turns a requested device into the
one the engine will use. Nothing here raises because a GPU, a driver or NVML is missing.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
from dataclasses import dataclass
from typing import Literal

import psutil

from engine.errors import NInferError

LOW_VRAM_MIB = 2048
LOW_RAM_MIB = 4096
_MIB = 1024 * 1024
_WHEEL_URL = "https://download.pytorch.org/whl/"
_ARCH_RE = re.compile(r"^(sm|compute)_(\d+)([a-z]?)$")

# First CUDA release able to build code for each compute capability.
_MIN_CUDA = {
    (5, 0): "6.5", (5, 2): "6.5", (5, 3): "6.5", (6, 0): "8.0", (6, 1): "8.0", (6, 2): "8.0",
    (7, 0): "9.0", (7, 2): "9.2", (7, 5): "10.0", (8, 0): "11.0", (8, 6): "11.1", (8, 7): "11.4",
    (8, 9): "11.8", (9, 0): "11.8", (10, 0): "12.8", (10, 3): "12.9", (11, 0): "13.0",
    (12, 0): "12.8", (12, 1): "12.9",
}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    capability: tuple[int, int]
    arch: str  # "sm_86"
    vram_total_mib: int
    vram_free_mib: int | None


@dataclass(frozen=True)
class Verdict:
    level: Literal["ok", "warning", "error"]
    message: str
    remedy: str


@dataclass(frozen=True)
class HardwareReport:
    torch_version: str
    cuda_version: str | None
    arch_list: list[str]
    gpus: list[GpuInfo]
    nvml: str
    ram_total_mib: int
    ram_available_mib: int
    cpu_count: int
    cpu_name: str
    verdicts: list[Verdict]
    device: str  # "cuda:N" or "cpu"

    def usable_gpu(self) -> GpuInfo | None:
        """The GPU the engine will run on, or None when it runs on the CPU."""
        if not self.device.startswith("cuda"):
            return None
        index = int(self.device.partition(":")[2] or 0)
        return next((g for g in self.gpus if g.index == index), None)

    def supports(self, gpu: GpuInfo) -> bool:
        """Whether this PyTorch build has code for ``gpu`` (an empty arch list on a CUDA build is trusted)."""
        if not self.cuda_version:
            return False
        return not self.arch_list or arch_supported(gpu.capability, self.arch_list)

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for gpu, entry in zip(self.gpus, data["gpus"]):
            entry["capability"] = list(gpu.capability)
            entry["supported"] = self.supports(gpu)
        usable = self.usable_gpu()
        data["usable_gpu"] = usable.index if usable else None
        return data


def _arch_key(entry: str) -> tuple[int, str]:
    m = _ARCH_RE.match(entry)
    return (int(m.group(2)), m.group(3)) if m else (0, entry)


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a build compiled for ``arch_list`` can run on a GPU of ``capability``.

    An exact sm_XY (or sm_XYa) entry counts; so does an sm_XY of the same major with a lower minor
    (cubins run on later minors of their major, e.g. sm_86 code on an sm_89 GPU), and a compute_XY
    PTX entry with XY <= capability (the driver JIT-compiles it). "a" entries only run on their exact GPU.
    """
    major, minor = capability
    for entry in arch_list:
        m = _ARCH_RE.match(entry.strip())
        if not m:
            continue
        kind, (a_major, a_minor), suffix = m.group(1), divmod(int(m.group(2)), 10), m.group(3)
        if (a_major, a_minor) == (major, minor):
            return True
        if suffix == "a":
            continue
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def summarise_arch_list(arch_list: list[str]) -> str:
    """"sm_50..sm_90", plus any PTX entries; numeric order, so sm_100 sorts after sm_90."""
    sms = sorted({a for a in arch_list if a.startswith("sm_")}, key=_arch_key)
    ptx = sorted({a for a in arch_list if a.startswith("compute_")}, key=_arch_key)
    parts = []
    if sms:
        parts.append(sms[0] if len(sms) == 1 else f"{sms[0]}..{sms[-1]}")
    if ptx:
        parts.append("PTX " + ", ".join(ptx))
    return " + ".join(parts) or "no CUDA architectures"


def _min_cuda(capability: tuple[int, int]) -> str:
    if capability in _MIN_CUDA:
        return _MIN_CUDA[capability]
    lower = [cap for cap in _MIN_CUDA if cap <= capability]  # unknown GPU: its nearest older sibling
    return _MIN_CUDA[max(lower)] if lower else "6.5"


def _wheel(capability: tuple[int, int]) -> str:
    """A ``pip install`` line for a PyTorch build that covers ``capability``."""
    need = tuple(int(p) for p in _min_cuda(capability).split("."))
    if need >= (12, 8):
        tag = f"cu{need[0]}{need[1]}"
    else:  # recent cu128 wheels start at sm_75; older GPUs need a cu126 wheel
        tag = "cu128" if capability >= (7, 5) else "cu126"
    return f"pip install torch --index-url {_WHEEL_URL}{tag}"


def _arch(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _reason(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def _torch_gpus(torch) -> list[GpuInfo]:
    """GPUs PyTorch itself can open; free VRAM from ``mem_get_info``."""
    try:
        if not torch.cuda.is_available():
            return []
        count = int(torch.cuda.device_count())
    except Exception:
        return []
    gpus = []
    for i in range(count):
        try:
            props = torch.cuda.get_device_properties(i)
        except Exception:
            continue
        cap = (int(props.major), int(props.minor))
        try:
            free_mib = int(torch.cuda.mem_get_info(i)[0]) // _MIB
        except Exception:
            free_mib = None
        gpus.append(GpuInfo(i, str(props.name), cap, _arch(cap), int(props.total_memory) // _MIB, free_mib))
    return gpus


def _nvml_gpus(nvml) -> tuple[str, list[GpuInfo]]:
    """(status, GPUs) as the NVIDIA driver sees them; never raises."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return "unavailable (nvidia-ml-py is not installed)", []
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return f"no NVIDIA GPU (NVML: {_reason(exc)})", []
    gpus: list[GpuInfo] = []
    try:
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            cap = tuple(int(x) for x in nvml.nvmlDeviceGetCudaComputeCapability(handle))
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuInfo(i, name, cap, _arch(cap), int(mem.total) // _MIB, int(mem.free) // _MIB))
        return "ok", gpus
    except Exception as exc:
        return f"NVML error: {_reason(exc)}", gpus
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def probe(*, torch_module=None, nvml_module=None) -> HardwareReport:
    """Inspect PyTorch, NVIDIA GPUs (via PyTorch and NVML), host RAM and CPU."""
    verdicts: list[Verdict] = []
    torch = torch_module
    if torch is None:
        try:
            import torch
        except Exception as exc:  # a broken install (e.g. missing CUDA libraries) still gets a report
            verdicts.append(Verdict("error", f"PyTorch cannot be imported: {_reason(exc)}.",
                                    "Reinstall PyTorch (pip install --force-reinstall torch)."))
    torch_version = str(getattr(torch, "__version__", "not importable"))
    cuda_version = getattr(getattr(torch, "version", None), "cuda", None)
    arch_list: list[str] = []
    torch_gpus: list[GpuInfo] = []
    if torch is not None and cuda_version:
        try:
            arch_list = list(torch.cuda.get_arch_list())
        except Exception:
            pass
        torch_gpus = _torch_gpus(torch)
    nvml, nvml_gpus = _nvml_gpus(nvml_module)

    usable = [g for g in torch_gpus if not arch_list or arch_supported(g.capability, arch_list)]
    chosen = usable[0] if usable else None
    verdicts += _gpu_verdicts(torch_version, cuda_version, arch_list, torch_gpus, nvml_gpus, chosen)

    vm = psutil.virtual_memory()
    ram_total, ram_available = int(vm.total) // _MIB, int(vm.available) // _MIB
    if ram_available < LOW_RAM_MIB:
        verdicts.append(Verdict(
            "warning",
            f"Only {ram_available} MiB of host RAM is available (of {ram_total} MiB): "
            "loading a model may fail or swap.",
            "Close other applications, or choose a smaller model or quantization."))

    return HardwareReport(
        torch_version=torch_version, cuda_version=cuda_version, arch_list=arch_list,
        gpus=torch_gpus or nvml_gpus, nvml=nvml,
        ram_total_mib=ram_total, ram_available_mib=ram_available,
        cpu_count=os.cpu_count() or psutil.cpu_count() or 1, cpu_name=_cpu_name(),
        verdicts=verdicts, device=f"cuda:{chosen.index}" if chosen else "cpu")


def _gpu_verdicts(torch_version, cuda_version, arch_list, torch_gpus, nvml_gpus, chosen) -> list[Verdict]:
    """GPU verdicts. While on the CPU, the first one says why (resolve_device relies on that)."""
    out = []
    fallback = (f"the engine uses GPU {chosen.index} meanwhile" if chosen
                else "the engine falls back to the CPU meanwhile")
    for g in torch_gpus:
        if arch_list and not arch_supported(g.capability, arch_list):
            out.append(Verdict(
                "warning" if chosen else "error",
                f"GPU {g.index} ({g.name}, {g.arch}) is not supported by this PyTorch build "
                f"(CUDA {cuda_version}, compiled for {summarise_arch_list(arch_list)}).",
                _arch_remedy(g, arch_list, fallback)))
    if chosen:
        out.append(Verdict("ok", f"GPU {chosen.index} ({chosen.name}, {chosen.arch}) is supported: "
                                 f"the engine will use cuda:{chosen.index}.", ""))
        free = chosen.vram_free_mib
        if free is not None and free < LOW_VRAM_MIB:
            out.append(Verdict(
                "warning",
                f"Only {free} MiB of {chosen.vram_total_mib} MiB VRAM is free on GPU {chosen.index}: "
                "something else is using the GPU (the desktop and other apps take 0.5-1 GB).",
                "Close other GPU applications (nvidia-smi lists them), or use a smaller model or context."))
    elif nvml_gpus and not torch_gpus:
        g = nvml_gpus[0]
        present = f"NVIDIA GPU {g.index} ({g.name}, {g.arch}) is present but"
        if not cuda_version:
            out.append(Verdict("warning", f"{present} this PyTorch is a CPU build (torch {torch_version}).",
                               f"Install a CUDA build of PyTorch ({_wheel(g.capability)}); {fallback}."))
        else:
            out.append(Verdict("warning", f"{present} PyTorch (CUDA {cuda_version}) cannot use it: "
                                          "torch.cuda.is_available() is False.",
                               f"Update the NVIDIA driver to one supporting CUDA {cuda_version} (nvidia-smi "
                               f"shows the highest it supports) and check CUDA_VISIBLE_DEVICES; {fallback}."))
    elif not torch_gpus:
        remedy = ("If this machine has an NVIDIA GPU, install the NVIDIA driver and a CUDA build of PyTorch "
                  f"(pip install torch --index-url {_WHEEL_URL}cu128)." if not cuda_version else
                  "If this machine has an NVIDIA GPU, install or update the NVIDIA driver "
                  "(nvidia-smi must list the GPU).")
        out.append(Verdict("warning", "No usable NVIDIA GPU: running on the CPU (slow for large models).",
                           remedy))
    return out


def _arch_remedy(gpu: GpuInfo, arch_list: list[str], fallback: str) -> str:
    sms = [_arch_key(a)[0] for a in arch_list if a.startswith("sm_")]
    if sms and gpu.capability[0] * 10 + gpu.capability[1] < min(sms):
        return (f"This PyTorch no longer ships code for {gpu.arch}: install a build whose "
                "torch.cuda.get_arch_list() includes it "
                f"(e.g. pip install torch --index-url {_WHEEL_URL}cu126); {fallback}.")
    return (f"Install a PyTorch built for CUDA {_min_cuda(gpu.capability)} or newer "
            f"({_wheel(gpu.capability)}); {fallback}.")


def resolve_device(requested: str = "auto", report: HardwareReport | None = None) -> str:
    """"auto" -> a usable GPU, else the CPU; "cuda" with no usable GPU -> NInferError saying why and what to do."""
    req = (requested or "auto").strip().lower()
    if req == "cpu":
        return "cpu"
    if req not in ("auto", "cuda"):
        raise NInferError(f"Unknown device {requested!r}.", 'Use "auto", "cpu" or "cuda".')
    report = report or probe()
    if req == "auto":
        return report.device
    asked = f'Device "{requested}" was requested but'
    if report.device == "cpu":
        problems = [v for v in report.verdicts if v.level != "ok"]
        if report.gpus and problems:
            problem = f"no NVIDIA GPU is usable. {problems[0].message}"
        elif report.nvml.startswith("no NVIDIA GPU"):
            problem = f"{report.nvml}."
        else:
            problem = f"no NVIDIA GPU was found (NVML: {report.nvml})."
        remedy = problems[0].remedy if problems else "Install the NVIDIA driver and a CUDA build of PyTorch."
        remedy = remedy.split("; the engine")[0].rstrip(".") + "."  # it will not fall back: it stops
        raise NInferError(f"{asked} {problem}", f'{remedy} Or use device "auto" or "cpu".')
    return report.device


def return_freed_memory() -> int:
    """Hands the heap memory freed since the last call back to the OS (glibc's malloc_trim; elsewhere nothing):
    loading a model frees the stacked and decoded copies its tensors were made from, and glibc keeps such memory
    in the process (a 0.56 GB MoE GGUF left 1.5 GB resident, 0.9 GB after). Returns the bytes of resident memory it
    gave back (0 where it cannot)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c") if platform.system() == "Linux" else None
    if not name:
        return 0
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return 0
    before = psutil.Process().memory_info().rss
    trim(0)
    return max(0, before - psutil.Process().memory_info().rss)
