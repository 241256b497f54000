"""`ninfer-serve hf:ORG/REPO[:QUANT]`: the model path is resolved through the library before the server starts."""
from __future__ import annotations

import pytest

from engine.serve import main, served_model_ids
from tests.library.conftest import Repo


def test_serve_offline_without_the_file_says_it_is_not_cached(hf_home, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["hf:test-org/Tiny-Llama-GGUF:Q4_K_M"]) == 2
    err = capsys.readouterr().err
    assert "hf:test-org/Tiny-Llama-GGUF:Q4_K_M is not in the model cache" in err and "HF_HUB_OFFLINE" in err


def test_serve_names_the_model_after_the_downloaded_file(tiny_repo, hf_home):
    from engine.config.loading import load_settings
    from engine.model.loader import resolve_model_path

    settings, _ = load_settings(["hf:test-org/Tiny-Llama-GGUF:Q8_0"])
    path = resolve_model_path(settings.model)
    assert served_model_ids(settings, path) == ["Tiny-Llama-Q8_0"]


@pytest.mark.slow
def test_the_engine_loads_and_answers_from_an_hf_reference(hub, hf_home):
    """The embedded model, published by the stand-in hub, downloaded into the cache by its hf: reference, loaded
    by the engine's builder (as ninfer-serve does) and answering."""
    from engine.build import build_engine
    from engine.model.default import default_model_path
    from engine.sampling import SamplingParams

    source = default_model_path()
    hub.add(Repo("test-org/SmolLM2-135M-Instruct-GGUF", {source.name: source.read_bytes()}))
    loaded = build_engine("hf:test-org/SmolLM2-135M-Instruct-GGUF:Q4_1", device="cpu", max_context=512,
                          max_concurrency=1)
    try:
        assert loaded.path.is_relative_to(hf_home / "hub") and loaded.path.name == source.name
        tok = loaded.tokenizer
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        out = loaded.engine.start().generate(prompt, SamplingParams(temperature=0, max_tokens=48))
        assert "Paris" in tok.decode(out)
    finally:
        loaded.engine.shutdown()


def test_ninfer_serve_records_the_models_last_use(tmp_path, monkeypatch):
    """ninfer-serve's loading thread notes the model's last use for the library, as the app does."""
    import time

    from engine.config.loading import load_settings
    from engine.library import usage
    from engine.model.default import default_model_path
    from engine.serve import load_in_background
    from engine.server.state import ServerState

    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "home"))
    settings, _ = load_settings(["--max-context", "256", "--device", "cpu"], env={})
    state = ServerState(settings, ["m"])
    before = time.time()
    load_in_background(state, settings).join(300)
    try:
        assert state.loaded is not None, state.load_error
        assert before <= usage.last_used(default_model_path()) <= time.time()
    finally:
        state.loaded.engine.shutdown()
