"""Which model class computes which architecture.

Names as the loaders report them (GGUF `general.architecture`, or engine.model.config.HF_ARCHS for config.json)
map to the class that builds and runs that model. The classes are named by path and imported when a model is
built, so that this table (and the configs checked against it) stays free of torch."""
from __future__ import annotations

import importlib

from engine.errors import ModelLoadError

MODELS: dict[str, str | type] = {
    "llama": "engine.model.llama:LlamaModel",
    "qwen2": "engine.model.llama:LlamaModel",
    "qwen3": "engine.model.llama:LlamaModel",
    "qwen35": "engine.model.qwen35:Qwen35Model",  # Gated-DeltaNet hybrids
}


def supported() -> tuple[str, ...]:
    return tuple(MODELS)


def register(arch: str, model_class: str | type) -> None:
    """Adds an architecture (a class, or its "module:Class" path)."""
    MODELS[arch] = model_class


def check_supported(arch: str) -> None:
    if arch not in MODELS:
        raise ModelLoadError(f"Model architecture '{arch}' is not supported.",
                             f"Supported: {', '.join(MODELS)} (SmolLM and Mistral use llama).")


def model_class(arch: str) -> type:
    check_supported(arch)
    entry = MODELS[arch]
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(importlib.import_module(module), name)
    return entry


def build_model(weights, dtype, device, weight_format: str = "", keep_native: bool = False, **options):
    """The model of `weights.config.arch` over these weights (see LlamaModel for the arguments; `options` are the
    class's own, e.g. Qwen35Model's state_fp16)."""
    return model_class(weights.config.arch)(weights, dtype, device, weight_format, keep_native, **options)
