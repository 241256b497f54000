"""Session-wide fixtures for the engine tests: the embedded default model (our engine and a transformers oracle of
the same GGUF), loaded once, and tiny random models built once per variant."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads, and when another process keeps the cores busy, OpenMP's
    spinning workers slow their small matmuls down by orders of magnitude: run such tests on one thread.
    (Engine threads started inside the test pick the setting up when they first compute.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_fp32_engine(engine_for):
    """The embedded SmolLM2 GGUF in float32 (the oracle tests compare fp32), started, for the whole session."""
    loaded = engine_for(None, max_concurrency=4, max_context=2048, weight_dtype="fp32")
    loaded.engine.start()
    return loaded


@pytest.fixture(scope="session")
def default_hf_oracle():
    """transformers' own reading of the same GGUF (dequantized to fp32)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine.model.default import default_model_path

    path = default_model_path()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    finally:
        hf_logging.enable_progress_bar()
    return model.eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random transformers models by variant name -> (hf_model, folder), built on first use."""
    from tests.engine.helpers import LLAMA3_ROPE, tiny_hf_model

    variants = {
        "llama": ("llama", {}),
        "qwen2": ("qwen2", {}),
        "qwen3": ("qwen3", {}),
        "llama-tied": ("llama", {"tie_word_embeddings": True}),
        "llama-rope3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    }
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, tuple] = {}

    def get(name: str):
        if name not in built:
            arch, overrides = variants[name]
            built[name] = tiny_hf_model(arch, root, seed=list(variants).index(name) + 1, name=name, **overrides)
        return built[name]

    return get
