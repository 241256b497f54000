"""Putting an engine together: device, dtypes, weights, KV capacity, tokenizer."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from engine.engine import Engine
from engine.errors import NInferError
from engine.kv.cache import PAGE_SIZE, KVCache
from engine.kv.quant import QUANT_KV_DTYPES
from engine.kv.window import WindowSpec
from engine.model.config import ModelConfig
from engine.model.linear import LOW_BIT, PREFILL_DENSE_ROWS, native_format
from engine.model.llama import LlamaModel
from engine.model.loader import load_weights
from engine.model.weights import Progress
from engine.runner import ModelRunner
from engine.spec.factory import make_speculator
from engine.spec.mtp import is_mtp_tensor

log = logging.getLogger("ninfer.build")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_KV_RAM_FRACTION = 0.25  # of available host RAM, for kv-capacity auto on the CPU


@dataclass
class LoadedEngine:
    engine: Engine
    tokenizer: "object"  # engine.tokenizer.Tokenizer
    config: ModelConfig
    path: Path
    device: torch.device
    dtype: torch.dtype
    load_seconds: float = 0.0

    @property
    def context_window(self) -> int:
        return self.engine.max_context


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def weight_format(name: str, weights) -> str:
    """The low-bit format of the linear weights ("" = dense): auto keeps what a GGUF file stores (Q4_0/Q4_1 -> int4,
    Q8_0 -> int8, TQ2_0 -> ternary) and runs other files dense."""
    if name == "auto":
        return native_format(weights.tensors) or ""
    return name if name in LOW_BIT else ""


def pick_kv_dtype(name: str, device: torch.device) -> torch.dtype | str:
    """The KV cache's format: auto = fp32 on the CPU, bf16 on CUDA (as the weights); a float name as its torch
    dtype; the quantized formats (k8v8, k8v4, k4v4, rk4v4) only when asked for, as their name."""
    if name in QUANT_KV_DTYPES:
        return name
    return pick_dtype(name, device)


def kv_pages(capacity: str | int, cfg: ModelConfig, max_context: int, max_concurrency: int,
             kv_dtype: torch.dtype | str, device: torch.device, headroom_mib: int, window_pages: int = 0) -> int:
    """Pages in the KV pool: an explicit token count, or what memory allows (never more than all sequences at
    full context need). `window_pages`: the GPU pages of one windowed sequence (0: no window)."""
    pages_per_seq = -(-max_context // PAGE_SIZE)
    if window_pages:
        pages_per_seq = min(pages_per_seq, window_pages)
    if capacity != "auto":
        return max(-(-int(capacity) // PAGE_SIZE), 1)
    want = pages_per_seq * max_concurrency
    page_bytes = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype) * PAGE_SIZE
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free - headroom_mib * 2**20
    else:
        budget = int(psutil.virtual_memory().available * CPU_KV_RAM_FRACTION)
    fits = budget // page_bytes
    if fits < pages_per_seq:
        need_mib = pages_per_seq * page_bytes / 2**20
        what = f"a windowed sequence ({pages_per_seq} pages)" if window_pages else f"one sequence of {max_context} tokens"
        raise NInferError(f"The KV cache for {what} needs {need_mib:.0f} MiB, "
                          f"but only {max(budget, 0) / 2**20:.0f} MiB are available for it.",
                          "Lower --max-context, or free memory (close other programs), or set --kv-capacity.")
    return int(min(want, fits))


def build_engine(model: str | Path | None = None, *, device: str = "auto", weight_dtype: str = "auto",
                 kv_dtype: str = "auto", max_context: int = 0, kv_capacity: str | int = "auto",
                 kv_headroom_mib: int = 1024, max_concurrency: int = 4, prefill_chunk: int = 512, threads: int = 0,
                 max_queue: int = 64, max_shared_prefixes: int | str = "auto", kv_window: int = 0,
                 kv_retrieve: int = 0, kv_ring: str = "auto", host_kv_mib: int = 0, host_pageable: bool = False,
                 allow_lossy_window: bool = False, kv_reuse_hostbacked: bool = False,
                 spec: str = "none", draft_tokens: int = 0, draft_model: str | None = None,
                 lm_head_draft: bool = False, prefill_cublas: bool = False, cuda_graphs: str = "auto",
                 progress: Progress | None = None, cancel: threading.Event | None = None) -> LoadedEngine:
    import time

    from engine.hardware import resolve_device
    from engine.tokenizer import Tokenizer

    t0 = time.perf_counter()
    dev = torch.device(resolve_device(device))
    if threads and dev.type == "cpu":
        torch.set_num_threads(threads)
    native = weight_dtype == "auto" or weight_dtype in LOW_BIT
    path, weights = load_weights(model, progress, cancel, native=native)
    cfg = weights.config
    log.info("loaded %s (%s, %s): %s", path.name, cfg.arch, weights.source_format, weights.storage_summary())
    tokenizer = Tokenizer.from_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
    fmt = weight_format(weight_dtype, weights)
    wdtype = pick_dtype("auto" if fmt or weight_dtype == "auto" else weight_dtype, dev)
    kdtype = pick_kv_dtype(kv_dtype, dev)
    net = LlamaModel(weights, wdtype, dev, fmt)
    log.info("weights: %s, %.0f MiB read per token", net.weight_format, net.weight_bytes() / 2**20)
    mtp_tensors = {n: t for n, t in weights.tensors.items() if is_mtp_tensor(n, cfg.num_layers)}
    del weights
    if max_context > cfg.max_position:
        raise NInferError(f"--max-context {max_context} is beyond this model's trained context of "
                          f"{cfg.max_position} tokens.", f"Use --max-context {cfg.max_position} or less (0 = the model's).")
    context = max_context or cfg.max_position
    window = WindowSpec(WindowSpec.round(kv_window), WindowSpec.round(kv_retrieve), kv_ring, prefill_chunk) \
        if kv_window and kv_ring != "off" else None
    pages = kv_pages(kv_capacity, cfg, context, max_concurrency, kdtype, dev, kv_headroom_mib,
                     window.footprint if window else 0)
    page_bytes = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kdtype) * PAGE_SIZE
    host_pages = host_kv_mib * 2**20 // page_bytes
    if host_kv_mib and not host_pages:
        raise NInferError(f"--host-kv-mib {host_kv_mib} holds no KV page of this model ({page_bytes / 2**20:.2f} MiB "
                          f"a page).", f"Raise --host-kv-mib to at least {-(-page_bytes // 2**20)}.")
    runner = ModelRunner(net, pages, kdtype, PAGE_SIZE, host_pages=host_pages, host_pinned=not host_pageable,
                         prefill_cublas=prefill_cublas, cuda_graphs=cuda_graphs)
    if prefill_cublas:
        log.info("prefill: low-bit layers run chunks of %d+ rows as dense matmuls%s", PREFILL_DENSE_ROWS,
                 "" if fmt else " (the weights are dense: nothing to do)")
    speculator = make_speculator(spec, target=net, runner=runner, tokenizer=tokenizer, target_path=path,
                                 draft_tokens=draft_tokens, draft_model=draft_model, lm_head_draft=lm_head_draft,
                                 weight_dtype=weight_dtype, mtp_weights=mtp_tensors)
    del mtp_tensors
    if speculator is not None:
        log.info("speculative decoding: %s, up to %d draft tokens", speculator.method, speculator.max_draft)
    engine = Engine(runner, max_concurrency=max_concurrency, prefill_chunk=prefill_chunk, max_context=context,
                    eos_ids=tokenizer.eos_token_ids, max_queue=max_queue, max_shared_prefixes=max_shared_prefixes,
                    kv_window=kv_window, kv_retrieve=kv_retrieve, kv_ring=kv_ring,
                    allow_lossy_window=allow_lossy_window, kv_reuse_hostbacked=kv_reuse_hostbacked,
                    speculator=speculator)
    return LoadedEngine(engine, tokenizer, cfg, path, dev, wdtype, time.perf_counter() - t0)
