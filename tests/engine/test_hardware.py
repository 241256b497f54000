import platform
from types import SimpleNamespace

import pytest

from engine import hardware
from engine.errors import NInferError
from engine.hardware import arch_supported, probe, resolve_device, summarise_arch_list

MIB = 1024 * 1024
OLD_ARCHES = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


class FakeCuda:
    def __init__(self, gpus, arch_list, available=True):
        self.gpus, self.arch_list, self.available = gpus, arch_list, available

    def is_available(self):
        return self.available

    def device_count(self):
        return len(self.gpus)

    def get_arch_list(self):
        return list(self.arch_list)

    def get_device_properties(self, i):
        name, (major, minor), total, _ = self.gpus[i]
        return SimpleNamespace(name=name, major=major, minor=minor, total_memory=total * MIB)

    def mem_get_info(self, i):
        _, _, total, free = self.gpus[i]
        return free * MIB, total * MIB


def fake_torch(gpus=(), arch_list=(), cuda="12.4", available=True):
    """gpus: (name, capability, total_mib, free_mib) tuples."""
    return SimpleNamespace(__version__=f"2.5.1+cu{cuda.replace('.', '')}" if cuda else "2.5.1+cpu",
                           version=SimpleNamespace(cuda=cuda),
                           cuda=FakeCuda(list(gpus), list(arch_list), available))


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    NVMLError = FakeNVMLError

    def __init__(self, gpus=(), init_error=None):
        self.gpus, self.init_error = list(gpus), init_error
        self.inits = self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h][0].encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.gpus[h][1]

    def nvmlDeviceGetMemoryInfo(self, h):
        _, _, total, free = self.gpus[h]
        return SimpleNamespace(total=total * MIB, free=free * MIB, used=(total - free) * MIB)


def no_nvml():
    return FakeNvml(init_error=FakeNVMLError("NVML Shared Library Not Found"))


@pytest.fixture
def plenty_of_ram(monkeypatch):
    ram = SimpleNamespace(total=64 * 1024 * MIB, available=48 * 1024 * MIB)
    monkeypatch.setattr(hardware.psutil, "virtual_memory", lambda: ram)


def levels(report):
    return [v.level for v in report.verdicts]


def test_real_machine_probe_degrades_to_cpu():
    import torch

    report = probe()
    assert report.torch_version == torch.__version__
    assert report.ram_total_mib > 0 and report.cpu_count >= 1 and report.cpu_name
    if torch.version.cuda is None:  # this CI machine: CPU build, no driver
        assert report.device == "cpu" and report.arch_list == [] and report.usable_gpu() is None
        assert resolve_device("auto", report) == "cpu"
    if not report.gpus:
        assert report.nvml.startswith("no NVIDIA GPU") or report.nvml.startswith("unavailable")
        assert "GPU" in report.verdicts[0].message and report.verdicts[0].remedy


def test_unsupported_new_gpu_is_an_error_and_falls_back_to_cpu(plenty_of_ram):
    torch = fake_torch([("NVIDIA GeForce RTX 5070 Ti", (12, 0), 16303, 15000)], OLD_ARCHES, cuda="12.4")
    report = probe(torch_module=torch, nvml_module=no_nvml())
    assert report.device == "cpu" and report.usable_gpu() is None
    assert report.gpus[0].arch == "sm_120" and report.gpus[0].vram_free_mib == 15000
    error = report.verdicts[0]
    assert error.level == "error"
    assert error.message == ("GPU 0 (NVIDIA GeForce RTX 5070 Ti, sm_120) is not supported by this PyTorch "
                             "build (CUDA 12.4, compiled for sm_50..sm_90).")
    assert "CUDA 12.8 or newer" in error.remedy and "whl/cu128" in error.remedy and "CPU" in error.remedy
    assert resolve_device("auto", report) == "cpu"
    with pytest.raises(NInferError) as exc:
        resolve_device("cuda", report)
    assert "sm_120" in exc.value.problem and "12.8" in exc.value.remedy


def test_supported_gpu_is_chosen(plenty_of_ram):
    torch = fake_torch([("NVIDIA GeForce RTX 3090", (8, 6), 24576, 23000)], OLD_ARCHES, cuda="12.4")
    report = probe(torch_module=torch, nvml_module=no_nvml())
    assert report.device == "cuda:0" and report.usable_gpu().name == "NVIDIA GeForce RTX 3090"
    assert levels(report) == ["ok"]
    assert resolve_device("auto", report) == "cuda:0"
    assert resolve_device("cuda", report) == "cuda:0"
    assert resolve_device("cpu", report) == "cpu"
    data = report.as_dict()
    assert data["gpus"][0]["supported"] is True and data["gpus"][0]["capability"] == [8, 6]
    assert data["usable_gpu"] == 0


def test_second_gpu_used_when_first_unsupported(plenty_of_ram):
    gpus = [("NVIDIA GeForce RTX 5090", (12, 0), 32000, 31000), ("NVIDIA GeForce RTX 3060", (8, 6), 12288, 12000)]
    report = probe(torch_module=fake_torch(gpus, OLD_ARCHES), nvml_module=no_nvml())
    assert report.device == "cuda:1"
    assert levels(report) == ["warning", "ok"]  # not an error: the engine still has a GPU
    assert "GPU 1" in report.verdicts[0].remedy


def test_cuda_requested_on_cpu_only_report_raises_with_remedy(plenty_of_ram):
    report = probe(torch_module=fake_torch(cuda=None), nvml_module=no_nvml())
    assert report.device == "cpu" and report.gpus == []
    assert report.verdicts[0].message == "No usable NVIDIA GPU: running on the CPU (slow for large models)."
    assert "CUDA build of PyTorch" in report.verdicts[0].remedy
    with pytest.raises(NInferError) as exc:
        resolve_device("cuda", report)
    assert "NVML Shared Library Not Found" in exc.value.problem
    assert "CUDA build" in exc.value.remedy and '"cpu"' in exc.value.remedy
    with pytest.raises(NInferError):
        resolve_device("tpu", report)


def test_ptx_entry_lets_newer_gpu_jit(plenty_of_ram):
    arches = OLD_ARCHES + ["compute_90"]
    torch = fake_torch([("NVIDIA GeForce RTX 5080", (12, 0), 16303, 15000)], arches)
    report = probe(torch_module=torch, nvml_module=no_nvml())
    assert report.device == "cuda:0" and levels(report) == ["ok"]
    assert summarise_arch_list(arches) == "sm_50..sm_90 + PTX compute_90"


def test_arch_supported_rules():
    assert arch_supported((8, 6), ["sm_86"])
    assert arch_supported((8, 9), ["sm_80", "sm_86"])  # same-major cubins run on later minors
    assert not arch_supported((8, 0), ["sm_86"])
    assert not arch_supported((12, 0), ["sm_50", "sm_90"])
    assert arch_supported((12, 0), ["sm_120a"])  # exact arch-specific build
    assert not arch_supported((12, 1), ["sm_120a"])  # "a" code runs only on its exact GPU
    assert arch_supported((12, 0), ["compute_90"])  # PTX JIT forward
    assert not arch_supported((8, 6), ["compute_90"])
    assert arch_supported((9, 0), ["compute_90a"]) and not arch_supported((10, 0), ["compute_90a"])
    assert not arch_supported((7, 5), [])


def test_summarise_sorts_numerically():
    assert summarise_arch_list(["sm_90", "sm_100", "sm_120", "sm_75", "sm_80"]) == "sm_75..sm_120"
    assert summarise_arch_list(["sm_86"]) == "sm_86"
    assert summarise_arch_list([]) == "no CUDA architectures"


def test_old_gpu_dropped_by_new_build(plenty_of_ram):
    torch = fake_torch([("Tesla P40", (6, 1), 24576, 24000)], ["sm_75", "sm_80", "sm_90", "sm_120"], cuda="12.8")
    report = probe(torch_module=torch, nvml_module=no_nvml())
    assert report.device == "cpu" and report.verdicts[0].level == "error"
    assert "sm_75..sm_120" in report.verdicts[0].message
    assert "no longer ships code for sm_61" in report.verdicts[0].remedy


def test_low_free_vram_warns(plenty_of_ram):
    torch = fake_torch([("NVIDIA GeForce RTX 3060", (8, 6), 12288, 1500)], OLD_ARCHES)
    report = probe(torch_module=torch, nvml_module=no_nvml())
    assert report.device == "cuda:0"
    warning = report.verdicts[-1]
    assert warning.level == "warning" and "1500 MiB" in warning.message and warning.remedy


def test_low_host_ram_warns(monkeypatch):
    monkeypatch.setattr(hardware.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=8192 * MIB, available=3000 * MIB))
    report = probe(torch_module=fake_torch(cuda=None), nvml_module=no_nvml())
    assert report.ram_available_mib == 3000
    assert any(v.level == "warning" and "3000 MiB of host RAM" in v.message and v.remedy
               for v in report.verdicts)


def test_nvml_error_degrades_cleanly(plenty_of_ram):
    nvml = no_nvml()
    report = probe(torch_module=fake_torch(cuda=None), nvml_module=nvml)
    assert report.nvml == "no NVIDIA GPU (NVML: NVML Shared Library Not Found)"
    assert report.gpus == [] and report.device == "cpu"
    assert all(v.level != "error" for v in report.verdicts)


def test_nvml_failure_mid_probe_still_shuts_down(plenty_of_ram):
    class Broken(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, h):
            raise FakeNVMLError("GPU is lost")

    nvml = Broken(gpus=[("NVIDIA GeForce RTX 3090", (8, 6), 24576, 23000)])
    report = probe(torch_module=fake_torch(cuda=None), nvml_module=nvml)
    assert report.nvml == "NVML error: GPU is lost"
    assert nvml.shutdowns == 1


def test_cpu_build_with_nvidia_gpu_says_install_cuda_build(plenty_of_ram):
    nvml = FakeNvml(gpus=[("NVIDIA GeForce RTX 4090", (8, 9), 24564, 22000)])
    report = probe(torch_module=fake_torch(cuda=None), nvml_module=nvml)
    assert nvml.inits == 1 and nvml.shutdowns == 1
    assert report.nvml == "ok" and report.device == "cpu"
    gpu = report.gpus[0]
    assert (gpu.name, gpu.arch, gpu.vram_free_mib) == ("NVIDIA GeForce RTX 4090", "sm_89", 22000)
    assert not report.supports(gpu)
    warning = report.verdicts[0]
    assert warning.level == "warning" and "CPU build" in warning.message and "RTX 4090" in warning.message
    assert "CUDA build of PyTorch" in warning.remedy and "download.pytorch.org/whl/cu128" in warning.remedy
    with pytest.raises(NInferError) as exc:
        resolve_device("cuda", report)
    assert "CPU build" in exc.value.problem


def test_cuda_build_that_cannot_reach_the_gpu_blames_the_driver(plenty_of_ram):
    nvml = FakeNvml(gpus=[("NVIDIA GeForce RTX 5070 Ti", (12, 0), 16303, 15000)])
    torch = fake_torch([("NVIDIA GeForce RTX 5070 Ti", (12, 0), 16303, 15000)],
                       ["sm_75", "sm_120"], cuda="12.8", available=False)
    report = probe(torch_module=torch, nvml_module=nvml)
    assert report.device == "cpu" and report.gpus[0].arch == "sm_120"
    assert "is_available() is False" in report.verdicts[0].message
    assert "driver" in report.verdicts[0].remedy and "12.8" in report.verdicts[0].remedy


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's malloc_trim: Linux only")
def test_freed_heap_memory_goes_back_to_the_os():
    """Memory freed in small blocks (as a model's loading frees its stacked and decoded tensors) stays resident under
    glibc until malloc_trim; return_freed_memory hands it back and says how much."""
    import torch

    from engine.hardware import return_freed_memory

    return_freed_memory()
    junk = [torch.empty(16000, dtype=torch.uint8).fill_(1) for _ in range(8000)]  # 16 KB each: heap, not mmap
    keep = junk[::100]  # a few blocks stay, as a loaded model's tensors do between the freed ones
    del junk
    assert return_freed_memory() > 100 * 2**20
    assert return_freed_memory() < 16 * 2**20  # nothing more to give
    del keep
