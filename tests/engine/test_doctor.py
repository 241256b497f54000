import json

import pytest

from engine.tools import doctor
from engine.hardware import GpuInfo, HardwareReport, Verdict


def test_doctor_on_this_machine_prints_report_and_device(capsys):
    import torch

    code = doctor.main([])
    out = capsys.readouterr().out
    assert torch.__version__ in out and "NVML" in out and "Host RAM" in out
    if torch.version.cuda is None:  # CPU build here: warnings only, engine on the CPU
        assert code == 0
        assert "The engine will use: cpu" in out
        assert "[WARN]" in out and "->" in out


def test_doctor_json_is_valid_and_complete(capsys):
    code = doctor.main(["--json"])
    data = json.loads(capsys.readouterr().out)
    for key in ("torch_version", "cuda_version", "arch_list", "gpus", "nvml", "ram_total_mib",
                "ram_available_mib", "cpu_count", "cpu_name", "verdicts", "device"):
        assert key in data
    assert data["device"] in ("cpu",) or data["device"].startswith("cuda:")
    assert all(set(v) == {"level", "message", "remedy"} for v in data["verdicts"])
    assert code == (1 if any(v["level"] == "error" for v in data["verdicts"]) else 0)


def _report(**overrides):
    gpu = GpuInfo(0, "NVIDIA GeForce RTX 5070 Ti", (12, 0), "sm_120", 16303, 15000)
    fields = dict(torch_version="2.5.1+cu124", cuda_version="12.4", arch_list=["sm_50", "sm_90"], gpus=[gpu],
                  nvml="ok", ram_total_mib=65536, ram_available_mib=40000, cpu_count=16, cpu_name="Test CPU",
                  verdicts=[Verdict("error", "GPU 0 (NVIDIA GeForce RTX 5070 Ti, sm_120) is not supported.",
                                    "Install a PyTorch built for CUDA 12.8 or newer.")],
                  device="cpu")
    fields.update(overrides)
    return HardwareReport(**fields)


def test_error_verdict_gives_exit_code_1_and_readable_text(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "probe", lambda: _report())
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "[ERROR] GPU 0 (NVIDIA GeForce RTX 5070 Ti, sm_120) is not supported." in out
    assert "-> Install a PyTorch built for CUDA 12.8 or newer." in out
    assert "sm_120 (compute capability 12.0), supported by this PyTorch: no" in out
    assert "VRAM 16303 MiB total, 15000 MiB free" in out
    assert "12.4, compiled for sm_50..sm_90" in out
    assert "The engine will use: cpu" in out


def test_ok_gpu_report(monkeypatch, capsys):
    gpu = GpuInfo(0, "NVIDIA GeForce RTX 3090", (8, 6), "sm_86", 24576, None)
    report = _report(gpus=[gpu], arch_list=["sm_80", "sm_86"], device="cuda:0",
                     verdicts=[Verdict("ok", "GPU 0 is supported.", "")])
    monkeypatch.setattr(doctor, "probe", lambda: report)
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "[OK]    GPU 0 is supported." in out and "->" not in out
    assert "supported by this PyTorch: yes" in out and "unknown free" in out
    assert "The engine will use: cuda:0 (NVIDIA GeForce RTX 3090)" in out
    assert doctor.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["usable_gpu"] == 0


def test_unknown_flag_is_rejected():
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--no-such-flag"])
    assert exc.value.code == 2
