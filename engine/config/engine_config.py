"""EngineConfig: the settings the engine reads, as one frozen dataclass with typed fields.

Built once from the effective settings (engine.config.loading.load_settings: flags, environment, TOML, presets) and handed
to build_engine, the Engine, the ledger and the speculator, which read the fields they use and nothing else. Each
field is a setting of the schema (engine/config/table.py: its flag, environment variable, TOML key, help and
validation); the defaults are the schema's, read from it, so nothing here is declared twice."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config.table import SETTINGS

_DEFAULTS = {s.name: s.default for s in SETTINGS}


def _default(name: str) -> Any:
    return field(default=_DEFAULTS[name])


@dataclass(frozen=True)
class EngineConfig:
    # where and in which formats the model runs
    device: str = _default("device")  # auto | cpu | cuda | cuda:N
    weight_dtype: str = _default("weight_dtype")  # auto | fp32 | bf16 | fp16 | int8 | int4 | ternary
    kv_dtype: str = _default("kv_dtype")  # auto | fp32 | fp16 | bf16 | k8v8 | k8v4 | k4v4 | rk4v4
    threads: int = _default("threads")  # CPU threads (0: PyTorch's choice)
    prefill_cublas: bool = _default("prefill_cublas")
    cuda_graphs: str = _default("cuda_graphs")  # auto | on | off
    cpu_compile: str = _default("cpu_compile")  # auto | off
    gdn_state_fp16: bool = _default("gdn_state_fp16")
    cpu_moe: bool = _default("cpu_moe")  # every MoE layer's experts in host memory, computed on the CPU
    n_cpu_moe: int = _default("n_cpu_moe")  # the first N MoE layers' experts there
    fit: bool = _default("fit")  # neither set: as few layers as make a MoE model fit (engine/ledger/placement.py)
    allow_lossy_format: bool = _default("allow_lossy_format")
    mmproj: str = _default("mmproj")  # a GGUF model's vision projector file ("": mmproj*.gguf beside it)
    max_image_pixels: int = _default("max_image_pixels")  # a vision model's largest image (scaled down beyond it)
    # how much it holds
    max_context: int = _default("max_context")  # 0: the model's (build_engine resolves it before the Engine runs)
    kv_capacity: int | str = _default("kv_capacity")  # tokens, or auto (from the ledger)
    kv_headroom_mib: int = _default("kv_headroom_mib")
    max_concurrency: int = _default("max_concurrency")
    max_queue: int = _default("max_queue")
    prefill_chunk: int = _default("prefill_chunk")
    max_shared_prefixes: int | str = _default("max_shared_prefixes")  # 0 turns prefix reuse off; auto
    # KV tiers (docs/KV.md)
    kv_window: int = _default("kv_window")
    kv_retrieve: int = _default("kv_retrieve")
    kv_ring: str = _default("kv_ring")  # auto | on | off
    host_kv_mib: int = _default("host_kv_mib")
    host_pageable: bool = _default("host_pageable")
    allow_lossy_window: bool = _default("allow_lossy_window")
    kv_reuse_hostbacked: bool = _default("kv_reuse_hostbacked")
    # speculative decoding (docs/SPECULATIVE.md)
    spec: str = _default("spec")  # none | ngram | draft | mtp
    draft_tokens: int = _default("draft_tokens")
    draft_model: str | None = _default("draft_model")
    lm_head_draft: bool = _default("lm_head_draft")

    def __post_init__(self):
        for name in ("max_concurrency", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be at least 1, not {getattr(self, name)}")

    @classmethod
    def from_settings(cls, settings: Any) -> "EngineConfig":
        """The engine's part of the effective settings (an engine.config.loading.Settings)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with some fields changed; an unknown name is a TypeError naming it."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"EngineConfig has no field {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    @property
    def speculative(self) -> bool:
        return self.spec not in ("none", "")
