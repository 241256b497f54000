"""`ninfer-serve hf:ORG/REPO[:QUANT]`: the model path is resolved through the library before the server starts."""
from __future__ import annotations

from engine.serve import main, served_model_ids


def test_serve_offline_without_the_file_says_it_is_not_cached(hf_home, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["hf:test-org/Tiny-Llama-GGUF:Q4_K_M"]) == 2
    err = capsys.readouterr().err
    assert "hf:test-org/Tiny-Llama-GGUF:Q4_K_M is not in the model cache" in err and "HF_HUB_OFFLINE" in err


def test_serve_names_the_model_after_the_downloaded_file(tiny_repo, hf_home):
    from engine.config import load_settings
    from engine.model.loader import resolve_model_path

    settings, _ = load_settings(["hf:test-org/Tiny-Llama-GGUF:Q8_0"])
    path = resolve_model_path(settings.model)
    assert served_model_ids(settings, path) == ["Tiny-Llama-Q8_0"]
