"""Settings: every effective setting as one typed dataclass attribute, plus where each value came from.

engine.config.loading.load_settings builds it from flags, environment, TOML files and presets. The schema
(engine/config/table.py) is the single source of each setting's flag, variable, help, validation and default;
the fields here only give each one its type for readers, editors and type checkers, and take the default from the
schema (tests/engine/test_settings_fields.py checks that the two agree, name for name and type for type)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config.table import SETTINGS

_DEFAULTS = {s.name: s.default for s in SETTINGS}


def _default(name: str) -> Any:
    return field(default=_DEFAULTS[name])


def _list(name: str) -> Any:
    return field(default_factory=lambda: list(_DEFAULTS[name]))


@dataclass
class Settings:
    """Effective settings: one attribute per setting (engine/config/table.py), plus `sources`."""
    # server
    model: str | None = _default("model")
    host: str = _default("host")
    port: int = _default("port")
    model_id: list[str] = _list("model_id")
    model_alias: list[str] = _list("model_alias")
    log_level: str = _default("log_level")
    api_key: str | None = _default("api_key")
    insecure_no_auth: bool = _default("insecure_no_auth")
    cors_origins: list[str] = _list("cors_origins")
    max_queue: int = _default("max_queue")
    max_body_mib: int = _default("max_body_mib")
    mcp_config: str = _default("mcp_config")
    image_url_fetch: bool = _default("image_url_fetch")
    max_image_mib: int = _default("max_image_mib")
    max_images: int = _default("max_images")
    # model
    device: str = _default("device")
    weight_dtype: str = _default("weight_dtype")
    max_context: int = _default("max_context")
    allow_lossy_format: bool = _default("allow_lossy_format")
    gdn_state_fp16: bool = _default("gdn_state_fp16")
    cpu_moe: bool = _default("cpu_moe")  # every MoE layer's experts in host memory, computed on the CPU
    n_cpu_moe: int = _default("n_cpu_moe")  # the first N MoE layers' experts there
    fit: bool = _default("fit")  # neither set: as few layers as make a MoE model fit (engine/ledger/placement.py)
    mmproj: str = _default("mmproj")  # a GGUF model's vision projector file ("": mmproj*.gguf beside it)
    max_image_pixels: int = _default("max_image_pixels")  # a vision model's largest image (scaled down beyond it)
    # memory
    kv_capacity: int | str = _default("kv_capacity")
    kv_headroom_mib: int = _default("kv_headroom_mib")
    kv_dtype: str = _default("kv_dtype")
    host_kv_mib: int = _default("host_kv_mib")
    max_shared_prefixes: int | str = _default("max_shared_prefixes")
    kv_window: int = _default("kv_window")
    kv_retrieve: int = _default("kv_retrieve")
    kv_ring: str = _default("kv_ring")
    allow_lossy_window: bool = _default("allow_lossy_window")
    host_pageable: bool = _default("host_pageable")
    kv_reuse_hostbacked: bool = _default("kv_reuse_hostbacked")
    # speculative
    spec: str = _default("spec")
    draft_tokens: int = _default("draft_tokens")
    draft_model: str | None = _default("draft_model")
    lm_head_draft: bool = _default("lm_head_draft")
    # sampling
    default_max_tokens: int = _default("default_max_tokens")
    default_reasoning_effort: str = _default("default_reasoning_effort")
    reasoning_budget: int = _default("reasoning_budget")  # -1: unrestricted (engine/server/thinking.py)
    reasoning_budget_message: str = _default("reasoning_budget_message")
    reasoning_preserve: str = _default("reasoning_preserve")
    mode: str = _default("mode")
    temperature: float | None = _default("temperature")
    top_p: float | None = _default("top_p")
    top_k: int | None = _default("top_k")
    min_p: float | None = _default("min_p")
    presence_penalty: float | None = _default("presence_penalty")
    frequency_penalty: float | None = _default("frequency_penalty")
    greedy: bool = _default("greedy")
    # performance
    threads: int = _default("threads")
    cuda_graphs: str = _default("cuda_graphs")
    cpu_compile: str = _default("cpu_compile")
    prefill_cublas: bool = _default("prefill_cublas")
    prefill_chunk: int = _default("prefill_chunk")
    max_concurrency: int = _default("max_concurrency")
    # how they were given
    sources: dict[str, str] = field(default_factory=dict)  # setting name -> where its value came from
    print_config: bool = False
    preset: str | None = None
    config: str | None = None

    def source(self, name: str) -> str:
        """Where the effective value of setting `name` came from, e.g. "default" or "flag:--port"."""
        if name not in _DEFAULTS:
            raise KeyError(f"no setting named {name!r}")
        return self.sources.get(name, "default")
