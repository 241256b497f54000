"""What a loader hands the model: its config, its tensors under HF names, and how they were stored."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.errors import ModelLoadError, NInferError
from engine.model.config import ModelConfig
from engine.model.registry import model_class
from kernels.quant import QuantizedWeight  # noqa: F401  (the type of low-bit tensors)

Progress = Callable[[float, str], None]


class LoadCancelled(NInferError):
    def __init__(self):
        super().__init__("Model loading was cancelled.")


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, "torch.Tensor | QuantizedWeight"]  # HF names (model.layers.0.self_attn.q_proj.weight ...):
    # float32 on the CPU, or low-bit linear weights kept as stored in a GGUF file (kernels.quant.QuantizedWeight)
    source_format: str  # "gguf" | "hf"
    storage: dict[str, str] = field(default_factory=dict)  # tensor name -> stored type (Q4_1, F32, bf16, ...)

    def storage_summary(self) -> str:
        counts: dict[str, int] = {}
        for kind in self.storage.values():
            counts[kind] = counts.get(kind, 0) + 1
        return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with its shape (out_features, in_features) for linears: as the model
    class of the architecture builds its layers (engine.model.registry), one set per layer kind."""
    return model_class(cfg.arch).expected_shapes(cfg)


def check_complete(cfg: ModelConfig, tensors: dict[str, torch.Tensor], where: str,
                   file_name: Callable[[str], str | None] | None = None) -> None:
    """Every expected tensor is present with the expected shape, or a ModelLoadError lists what is wrong
    (`file_name`: the name the file gives a tensor, said beside its HF name)."""
    problems = []
    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        stored = file_name(name) if file_name is not None else None
        shown = f"{name} ({stored})" if stored else name
        if t is None:
            problems.append(f"missing {shown}")
        elif tuple(t.shape) != shape:
            problems.append(f"{shown} has shape {tuple(t.shape)}, expected {shape}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ModelLoadError(f"{where} does not match its own configuration: {shown}.",
                             "The file is incomplete or damaged; download or convert it again.")


class Ticker:
    """Reports load progress and honours cancellation between tensors."""

    def __init__(self, total: int, progress: Progress | None, cancel: threading.Event | None):
        self.total, self.done, self.progress, self.cancel = max(total, 1), 0, progress, cancel

    def step(self, message: str) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise LoadCancelled()
        self.done += 1
        if self.progress is not None:
            self.progress(min(self.done / self.total, 1.0), message)
