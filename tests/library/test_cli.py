"""`python -m engine.library`: each command against the stand-in hub."""
from __future__ import annotations

from engine.library.cli import main


def test_search_files_download_list(tiny_repo, hf_home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    assert main(["search", "tiny"]) == 0
    assert "test-org/Tiny-Llama-GGUF" in capsys.readouterr().out
    assert main(["files", tiny_repo.repo_id, "--vram-mib", "0", "--ram-mib", "16000"]) == 0
    out = capsys.readouterr().out
    assert "Tiny-Llama-Q4_K_M.gguf" in out and "Q4_K_M" in out and "fits:" in out
    assert main(["download", f"hf:{tiny_repo.repo_id}:Q8_0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("Tiny-Llama-Q8_0.gguf") and "100.0%" in captured.err
    assert main(["list"]) == 0
    assert "test-org/Tiny-Llama-GGUF/Tiny-Llama-Q8_0.gguf" in capsys.readouterr().out


def test_errors_are_printed_with_the_remedy(hf_home, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["download", "hf:test-org/Absent-GGUF:Q4_K_M"]) == 1
    err = capsys.readouterr().err
    assert "error: hf:test-org/Absent-GGUF:Q4_K_M is not in the model cache" in err and "->" in err
