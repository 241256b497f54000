"""Runs the model over scheduled work: builds the flat token batch and its page/slot metadata, returns logits."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.memory.kv.table import PageTable
from engine.memory.build import allocate
from engine.memory.geometry import PAGE_SIZE, pads
from engine.memory.state import SeqState
from engine.batch import ForwardBatch
from engine.model.cpu_hybrid import make as cpu_fused_step
from engine.model.cpu_step import CompiledStep
from engine.model.graphs import DecodeGraphs, resolve_cuda_graphs
from engine.model.interrupt import Interrupt
from engine.model.linear import dense_prefill_rows, enable_dense_prefill
from kernels import dispatch

log = logging.getLogger("ninfer.model")


@dataclass
class Work:
    """Compute `tokens` of one sequence, which start at position `start`; its KV pages are `pages` (its page
    table, engine/memory/kv/table.py), its recurrent state `state` (models with recurrent layers)."""
    tokens: list[int]
    start: int
    pages: PageTable
    logits: str | None = "last"  # "last", "all" or None
    state: SeqState | None = None
    aborted: Callable[[], bool] | None = None  # asked between layers: True, and it leaves the step (interrupt.py)
    rope_delta: int = 0  # after a prompt with images: token i rotates at position i + rope_delta (all rows equal)
    rope_positions: torch.Tensor | None = None  # a chunk of a prompt with images: its M-RoPE positions [3, n]
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # ... and (indices in the chunk, image embeddings)


class ModelRunner:
    def __init__(self, model, num_pages: int, kv_dtype: torch.dtype, page_size: int = PAGE_SIZE, host_pages: int = 0,
                 host_pinned: bool = True, prefill_cublas: bool = False, cuda_graphs: str = "off",
                 static_decode: bool = False, state_slots: int = 0, max_batch: int = 0, cpu_step: bool = False,
                 cpu_fused: bool = False):
        """`host_pages`: pages of the host KV tier (0: none); `host_pinned`: page-locked host memory on CUDA;
        `prefill_cublas`: low-bit layers run chunks of dense_prefill_rows+ rows as dense matmuls (linear.DenseScratch);
        `cuda_graphs` auto|on|off: decode steps replayed as CUDA graphs (engine/model/graphs.py); every decode step
        runs the same static forward, recorded or not; `static_decode`: run it uncaptured exactly as a graph would
        (power-of-two buckets, dummy rows, the page-table kernel's twin on the CPU): the tests of what graphs record;
        `state_slots`: recurrent-state slots (engine/memory/state.py), for a model with recurrent layers;
        `max_batch`: the most sequences a step runs (0: unknown); padded batches of more than 2 have dummy rows,
        whose recurrent state steps in one more, scratch, slot; `cpu_step` (--cpu-compile step): on the CPU, a decode
        step of one sequence runs as one compiled graph (engine/model/cpu_step.py), where it compiles; `cpu_fused`
        (--cpu-compile auto): on the CPU, decode steps run as one C++ call (engine/model/cpu_fused.py, a hybrid's
        cpu_hybrid.py), where the model's layers and KV cache allow it.

        The pools are allocated from the model's `cache_specs` (engine/memory/build.allocate); `kv`, `pool`, `host`
        and `state` are its parts."""
        self.model = model
        self.device = model.device
        capture = resolve_cuda_graphs(cuda_graphs, torch.device(model.device),
                                      getattr(model.cfg, "moe", None) is not None)
        padded = capture or static_decode
        self.pools = allocate(model.cache_specs, model.device, num_pages, kv_dtype, page_size, host_pages=host_pages,
                              host_pinned=host_pinned, state_slots=state_slots, padded=padded,
                              state_scratch=padded and pads(max_batch))
        self.kv, self.pool, self.host, self.state = self.pools.kv, self.pools.pages, self.pools.host, self.pools.state
        self.page_size = page_size
        self.dense_prefill = (enable_dense_prefill(model, dense_prefill_rows(torch.device(model.device)))
                              if prefill_cublas else None)
        # the CPU reads each row's pages as views (the page-table twin would gather them); where Triton runs (CUDA,
        # or the interpreter in the tests) the page-table kernel reads them in place
        device = torch.device(model.device)
        row_views = device.type == "cpu" and not static_decode and not dispatch.use_triton(device)
        self.graphs = DecodeGraphs(self, num_pages, capture, padded=padded, row_views=row_views)
        if cpu_step:
            self.graphs.compiled = self._compiled_step(row_views)
        if cpu_fused and row_views:
            self.graphs.fused = cpu_fused_step(self)

    def _compiled_step(self, row_views: bool) -> CompiledStep | None:
        step = CompiledStep(self)
        why = step.ready() if row_views else "the model does not run on the CPU's eager path (a GPU, or Triton)"
        if why is None:
            return step
        fix = ("install a C++ compiler (g++ or clang), or use --cpu-compile auto" if "compiler" in why.lower() else
               "use --cpu-compile auto to skip the compile at start")
        log.warning("--cpu-compile step: decode steps are not compiled (%s); they run eagerly: %s.", why, fix)
        return None

    def release(self) -> None:
        """Once its engine has stopped: drops what process-wide caches keep of this runner (the compiled decode
        step), so the model and its pools go with the last reference to them."""
        if self.graphs is not None and self.graphs.compiled is not None:
            self.graphs.compiled.release()
            self.graphs.compiled = None

    def run(self, works: list[Work]) -> list[torch.Tensor | None]:
        """Each work's logits rows (None: none asked, or it was interrupted: a work whose `aborted` says so between
        two layers of a general forward leaves the step; self.interrupted lists them afterwards)."""
        self.interrupted: set[int] = set()
        if self.graphs is not None and self.graphs.why_not(works) is None:
            return self.graphs.run(works)
        ids, positions, slots, seqs, rows = [], [], [], [], []
        row_spans: list[tuple[int, int] | None] = []
        q_start = 0
        for w in works:
            n = len(w.tokens)
            ctx = w.start + n
            delta = w.rope_delta if w.rope_positions is None else 0  # a chunk with images: rope_positions rule
            pos = list(range(w.start + delta, ctx + delta))
            ids.extend(w.tokens)
            positions.extend(pos)
            w.pages.bind(self.kv, w.start, n)
            slots.extend(w.pages.slots(w.start, n))
            s = w.pages.seq_slice(q_start, n, ctx, self.device)
            if w.state is not None:
                s.state, s.saves = w.state.slot, tuple(w.state.saves)
            seqs.append(s)
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
            seqs=seqs, kv=self.kv, state=self.state,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=dev),
            max_position=max(positions),
            **_image_inputs(works, positions, dev),
        )
        checks = [(i, w.aborted) for i, w in enumerate(works) if w.aborted is not None]
        if not checks:
            logits = self.model.forward(batch)  # always: a step without logit rows still writes its KV
        else:
            interrupt = Interrupt(lambda: [i for i, aborted in checks if aborted()])
            logits = self.model.forward(batch, interrupt)
            self.interrupted = interrupt.dropped
        out, row = [], 0  # the logits hold the rows of the works that stayed
        for i, span in enumerate(row_spans):
            if span is None or i in self.interrupted:
                out.append(None)
            else:
                out.append(logits[row:row + span[1]])
                row += span[1]
        return out


def _image_inputs(works: list[Work], positions: list[int], device) -> dict:
    """The ForwardBatch fields of a step with image tokens: M-RoPE positions [3, T] (the works without images
    have their 1-D positions in all three rows) and the image rows at their flat indices; {} for a text-only step."""
    if all(w.rope_positions is None and w.image_rows is None for w in works):
        return {}
    rope, indices, values, q_start = [], [], [], 0
    for w in works:
        n = len(w.tokens)
        rope.append(w.rope_positions if w.rope_positions is not None
                    else torch.tensor(positions[q_start:q_start + n]).expand(3, -1))
        if w.image_rows is not None:
            indices.append(w.image_rows[0] + q_start)
            values.append(w.image_rows[1])
        q_start += n
    image_rows = (torch.cat(indices).to(device), torch.cat(values).to(device)) if indices else None
    return dict(rope_positions=torch.cat(rope, dim=1).to(device), image_rows=image_rows)
