"""Runs the model over scheduled work: builds the flat token batch and its page/slot metadata, returns logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.cache import KVCache
from engine.kv.host import HostPool
from engine.kv.pages import PagePool
from engine.kv.window import TieredPages
from engine.model.batch import ForwardBatch, SeqSlice
from engine.model.graphs import DecodeGraphs, resolve_cuda_graphs
from engine.model.linear import PREFILL_DENSE_ROWS, enable_dense_prefill


@dataclass
class Work:
    """Compute `tokens` of one sequence, which start at position `start`; its KV pages are `pages` (a page list, or
    the TieredPages table of a windowed sequence)."""
    tokens: list[int]
    start: int
    pages: list[int]
    logits: str | None = "last"  # "last", "all" or None


class ModelRunner:
    def __init__(self, model, num_pages: int, kv_dtype: torch.dtype, page_size: int = 64, host_pages: int = 0,
                 host_pinned: bool = True, prefill_cublas: bool = False, cuda_graphs: str = "off",
                 static_decode: bool = False):
        """`host_pages`: pages of the host KV tier (0: none); `host_pinned`: page-locked host memory on CUDA;
        `prefill_cublas`: low-bit layers run chunks of PREFILL_DENSE_ROWS+ rows as dense matmuls (linear.DenseScratch);
        `cuda_graphs` auto|on|off: decode steps replayed as CUDA graphs (engine/model/graphs.py); `static_decode`:
        without graphs, run decode steps through the same static forward, called directly (the CPU tests)."""
        cfg = model.cfg
        self.model = model
        self.device = model.device
        capture = resolve_cuda_graphs(cuda_graphs, torch.device(model.device))
        static = capture or static_decode  # one more KV page: the scratch page of the static batches' dummy rows
        self.kv = KVCache(cfg.num_layers, num_pages + static, cfg.num_kv_heads, cfg.head_dim, kv_dtype,
                          model.device, page_size)
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.host = HostPool(self.kv, host_pages, host_pinned) if host_pages else None
        self.dense_prefill = enable_dense_prefill(model, PREFILL_DENSE_ROWS) if prefill_cublas else None
        self.graphs = DecodeGraphs(self, num_pages, capture) if static else None

    def run(self, works: list[Work]) -> list[torch.Tensor | None]:
        if self.graphs is not None and self.graphs.why_not(works) is None:
            return self.graphs.run(works)
        ids, positions, slots, seqs, rows = [], [], [], [], []
        row_spans: list[tuple[int, int] | None] = []
        q_start = 0
        for w in works:
            n = len(w.tokens)
            ctx = w.start + n
            pos = list(range(w.start, ctx))
            ids.extend(w.tokens)
            positions.extend(pos)
            if isinstance(w.pages, TieredPages):
                w.pages.prepare(self.kv, w.start, n)
                slots.extend(w.pages.slot(p) for p in pos)
                seqs.append(SeqSlice(q_start, n, ctx, None, w.pages))
            else:
                slots.extend(w.pages[p // self.page_size] * self.page_size + p % self.page_size for p in pos)
                held = w.pages[: -(-ctx // self.page_size)]
                pages = torch.tensor(held, dtype=torch.long, device=self.device)
                run = held[-1] - held[0] == len(held) - 1 and held == list(range(held[0], held[-1] + 1))
                seqs.append(SeqSlice(q_start, n, ctx, pages, first_page=held[0] if run else None))
            if w.logits == "all":
                row_spans.append((len(rows), n))
                rows.extend(range(q_start, q_start + n))
            elif w.logits == "last":
                row_spans.append((len(rows), 1))
                rows.append(q_start + n - 1)
            else:
                row_spans.append(None)
            q_start += n
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slots=torch.tensor(slots, dtype=torch.long, device=dev),
            seqs=seqs, kv=self.kv,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            max_position=max(positions),
        )
        logits = self.model.forward(batch)  # always: a step without logit rows still writes its KV
        return [None if span is None else logits[span[0]:span[0] + span[1]] for span in row_spans]
