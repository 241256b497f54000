"""The host tier: KV pages in host memory (pinned unless asked otherwise), with a Quest summary per page and layer.

A windowed sequence writes each of its pages through to the host once the page is full and computed, so that
dropping the GPU copy later costs nothing; a page comes back to the GPU, one layer at a time, when the selection
picks it (engine/memory/kv/window.py). On a machine without a GPU both tiers are ordinary memory: the same code runs.
The summaries live on the compute device, where the queries that score them are.
"""
from __future__ import annotations

import time

import torch

from engine.memory.kv.cache import KVCache
from engine.memory.kv.pages import PagePool
from engine.memory.kv.summary import page_summary


class HostPool:
    def __init__(self, gpu: KVCache, num_pages: int, pinned: bool):
        """`gpu`: the device cache this tier backs (same format, layers and heads)."""
        self.device = gpu.k[0].device
        pin = pinned and self.device.type == "cuda" and torch.cuda.is_available()
        self.pinned = pin
        self.kv = KVCache(gpu.num_layers, num_pages, gpu.num_kv_heads, gpu.head_dim, gpu.kv_dtype,
                          torch.device("cpu"), gpu.page_size, pin=pin)
        self.pool = PagePool(num_pages, gpu.page_size)
        shape = (gpu.num_layers, num_pages, gpu.num_kv_heads, gpu.head_dim)
        self.kmin = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.kmax = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.page_bytes = self.kv.page_bytes
        self.counters = dict(kv_writethrough_pages=0, kv_retrieved_pages=0, kv_retrieved_bytes=0,
                             kv_retrieve_seconds=0.0)

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def store(self, gpu: KVCache, gpu_pages: list[int], host_pages: list[int]) -> None:
        """Copies whole GPU pages (every layer, codes and scales) to host pages and records their summaries."""
        if not gpu_pages:
            return
        src = torch.tensor(gpu_pages, dtype=torch.long, device=self.device)
        dst = torch.tensor(host_pages, dtype=torch.long)
        for layer in range(gpu.num_layers):
            for g, h in zip(gpu.layer_tensors(layer), self.kv.layer_tensors(layer)):
                h.index_copy_(0, dst, g.index_select(0, src).cpu())
            lo, hi = page_summary(gpu.gather_keys(layer, src), gpu.page_size)
            dst_dev = dst.to(self.device)
            self.kmin[layer].index_copy_(0, dst_dev, lo)
            self.kmax[layer].index_copy_(0, dst_dev, hi)
        self.counters["kv_writethrough_pages"] += len(gpu_pages)

    def fetch(self, gpu: KVCache, layer: int, host_pages: list[int], gpu_pages: list[int]) -> None:
        """Brings one layer of host pages into GPU pages (asynchronously from pinned memory on CUDA)."""
        if not host_pages:
            return
        t0 = time.perf_counter()
        for g, h in zip(gpu.layer_tensors(layer), self.kv.layer_tensors(layer)):
            for hp, gp in zip(host_pages, gpu_pages):
                g[gp].copy_(h[hp], non_blocking=self.pinned)
        c = self.counters
        c["kv_retrieved_pages"] += len(host_pages)
        c["kv_retrieved_bytes"] += len(host_pages) * self.page_bytes // gpu.num_layers
        c["kv_retrieve_seconds"] += time.perf_counter() - t0
