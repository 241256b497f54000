"""The decode step: every sequence computes one token over a plain page list, through one static forward on every
device; on CUDA with --cuda-graphs it is captured as one CUDA graph per (batch, pages) bucket and replayed.

The step runs on fixed-size tensors: input ids, positions, KV slots and context lengths [B], a page table [B, P].
Captured (and where asked, `padded`: the tests of what a graph records), B and P are powers of two (1, 2, 4, ...):
rows past the real sequences are dummies (token 0 at position 0, written to a scratch KV page that the page pool
never hands out, attending to that one slot), so no shape depends on the data; each bucket is captured once (after
a warm-up on a side stream) and replayed after copying the step's inputs into its tensors. Uncaptured, B and P are
the step's own sizes. Attention reads the page table through the paged decode kernel (Triton on CUDA, its PyTorch
twin otherwise); on the CPU each row instead reads its pages as one view where they are consecutive
(`DecodeTable.rows`: the twin would gather them), which is why the CPU decodes as fast through this path as the
per-sequence attention of prefill steps.

Models with recurrent layers decode the same way: each row also names its state slot (dummy rows: the state pool's
scratch slot), and the recurrent layers step every row's state together; the state snapshots a step saves are copied
after it, outside the graph.

On the CPU with --cpu-compile step, a step of one sequence on consecutive pages runs as one compiled graph instead
(engine/model/cpu_step.py). Everything else runs through the runner's general forward: prefill and mixed steps,
speculative verification (several tokens per sequence), windowed (TieredPages) sequences, and steps while MTP reads
hidden states; the unusual ones are logged once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.errors import NInferError
from engine.batch import DecodeTable, ForwardBatch
from kernels import dispatch

log = logging.getLogger("ninfer.graphs")

MAX_BATCH = 256  # the largest --max-concurrency


def bucket(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def resolve_cuda_graphs(setting: str, device: torch.device, moe: bool = False) -> bool:
    """auto: on where the device is CUDA and Triton is usable (the decode attention kernel) and the model has no
    mixture-of-experts layers (their routing picks the experts on the host, every step); on: the same, or a clear
    refusal; off: never."""
    usable = device.type == "cuda" and dispatch.use_triton(device)
    if setting == "off" or (setting == "auto" and (not usable or moe)):
        return False
    if setting not in ("auto", "on"):
        raise NInferError(f"--cuda-graphs {setting} is not a choice.", "Use auto, on or off.")
    if device.type != "cuda":
        raise NInferError(f"--cuda-graphs on needs a CUDA GPU, but the model runs on the {device.type}.",
                          "Use --cuda-graphs auto (on whenever a CUDA GPU runs the model) or off; or run on a "
                          "GPU with --device cuda.")
    if not usable:
        raise NInferError("--cuda-graphs on needs Triton for the decode attention kernel, and Triton is not usable "
                          "here (not installed, or NINFER_NO_TRITON is set).",
                          "Install triton (or unset NINFER_NO_TRITON), or use --cuda-graphs auto or off.")
    if moe:
        raise NInferError("--cuda-graphs on: this model has mixture-of-experts layers, whose experts are chosen on "
                          "the host at every step, which a recorded graph cannot do.",
                          "Use --cuda-graphs auto or off for MoE models.")
    return True


@dataclass
class _Static:
    """One bucket's static tensors (its graph and output once captured or run)."""
    batch: int
    pages: int
    host: torch.Tensor  # int64 [5B + B*P]: ids, positions, slots, ctx_lens, state slots, page table, on the host
    flat: torch.Tensor  # the same on the device: copied in one transfer per step
    forward: ForwardBatch
    table64: torch.Tensor
    ctx64: torch.Tensor
    graph: "torch.cuda.CUDAGraph | None" = None
    out: torch.Tensor | None = None
    runs: int = 0


class DecodeGraphs:
    """The decode path of one ModelRunner. `capture`: record CUDA graphs (CUDA only); `padded`: power-of-two buckets
    with dummy rows, as captured graphs have them, without capturing (the tests); neither: each step's own sizes.
    `row_views`: attention reads each row's pages as views (the CPU) instead of through the page-table kernel. The
    runner reserves KV page `scratch_page` (beyond its page pool) for the dummy rows."""

    def __init__(self, runner, scratch_page: int, capture: bool, padded: bool = False, row_views: bool = False):
        if capture and runner.device.type != "cuda":
            raise NInferError("CUDA graphs need a CUDA device.", "Use --cuda-graphs off on the CPU.")
        self.runner, self.model, self.kv, self.state = runner, runner.model, runner.kv, runner.state
        self.capture = capture
        self.padded = capture or padded
        self.row_views = row_views
        self.scratch_page = scratch_page
        self.page_size = runner.page_size
        self.entries: dict[tuple[int, int], _Static] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0  # decode steps run through this path
        self.compiled = None  # engine.model.cpu_step.CompiledStep, set by the runner for --cpu-compile step
        self.fused = None  # engine.model.cpu_fused.FusedDecode, set by the runner for --cpu-compile auto
        self._told: set[str] = set()

    # ---- which steps ------------------------------------------------------------------------------------------
    def why_not(self, works) -> str | None:
        """None when this step can run static; else why not (unusual reasons are logged once)."""
        if not works or any(len(w.tokens) != 1 or w.logits not in ("last", "all") for w in works):
            return "not a decode step"  # prefill, mixed and verification steps: expected, not logged
        reason = None
        if any(w.rope_positions is not None or w.image_rows is not None for w in works):
            return "a prompt chunk with images"  # its last prompt token, alone in its step: expected, not logged
        if any(w.pages.windowed for w in works):
            reason = "a windowed (TieredPages) sequence"
        elif getattr(self.model, "keep_hidden", False):
            reason = "MTP drafting reads the hidden states"
        elif len(works) > MAX_BATCH:
            reason = f"more than {MAX_BATCH} sequences"
        if reason and reason not in self._told:
            self._told.add(reason)
            log.info("decode steps with %s run through the general forward", reason)
        return reason

    # ---- the static forward -----------------------------------------------------------------------------------
    def _entry(self, batch: int, pages: int) -> _Static:
        """The bucket's tensors: made (and captured) once where padded, made for this step alone otherwise."""
        key = (batch, pages)
        if key in self.entries:
            return self.entries[key]
        e = self._new(batch, pages)
        if self.padded:
            self._fill(e, [])  # every row a dummy while warming up and capturing
            e.flat.copy_(e.host)
            if self.capture:
                self._capture(e)
            self.entries[key] = e
        return e

    def _new(self, batch: int, pages: int) -> _Static:
        dev = self.runner.device
        n = 5 * batch + batch * pages
        host = torch.zeros(n, dtype=torch.long, pin_memory=self.capture)
        flat = torch.zeros(n, dtype=torch.long, device=dev)
        ids, positions, slots, ctx, states = flat[:5 * batch].view(5, batch)
        table64 = flat[5 * batch:].view(batch, pages)
        decode = DecodeTable(torch.zeros(batch, pages, dtype=torch.int32, device=dev),
                             torch.zeros(batch, dtype=torch.int32, device=dev),
                             states if self.state is not None else None)
        fb = ForwardBatch(input_ids=ids, positions=positions, slots=slots, seqs=[], kv=self.kv, state=self.state,
                          logit_rows=None, max_position=0, decode=decode)
        return _Static(batch, pages, host, flat, fb, table64, ctx)

    def _forward(self, e: _Static) -> torch.Tensor:
        e.forward.decode.page_table.copy_(e.table64)  # int32 for the kernel, inside the graph
        e.forward.decode.ctx_lens.copy_(e.ctx64)
        return self.model.forward(e.forward)

    def _capture(self, e: _Static) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the Triton kernels, settles the allocator
                self._forward(e)
        torch.cuda.current_stream().wait_stream(side)
        e.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(e.graph, pool=self.pool):
            e.out = self._forward(e)
        log.info("CUDA graphs: captured batch %d, %d pages", e.batch, e.pages)

    REPLAY_TOLERANCE = 1e-3  # of the largest logit: the same kernels on the same inputs, recorded or not

    def _replay_matches(self, e: _Static, works) -> bool:
        """A captured graph's first real step, checked once against the same static forward run eagerly (the rows'
        recurrent states are put back in between: the step moves them forward; K/V are rewritten with the same
        values). On a mismatch the states are put back once more, for the eager step that replaces it."""
        slots = [w.state.slot for w in works if w.state is not None]
        before = self.state.read(slots) if slots else None
        e.graph.replay()
        replayed = e.out.clone()
        if slots:
            self.state.write(slots, before)
        eager = self._forward(e)
        scale = eager.abs().max().clamp_min(1e-6)
        same = bool(((replayed - eager).abs().max() / scale) <= self.REPLAY_TOLERANCE)
        if not same and slots:
            self.state.write(slots, before)
        return same

    def _give_up(self, works, why: str) -> list[torch.Tensor]:
        log.warning("CUDA graphs: %s; decoding without graphs from now on", why)
        self.entries.clear()
        self.runner.graphs = None
        return self.runner.run(works)

    def _fill(self, e: _Static, works) -> None:
        b, ps = e.batch, self.page_size
        h = e.host
        h.zero_()
        ids, positions, slots, ctx, states = h[:5 * b].view(5, b)
        table = h[5 * b:].view(b, e.pages)
        table.fill_(self.scratch_page)
        slots.fill_(self.scratch_page * ps)
        ctx.fill_(1)
        if self.state is not None and self.state.scratch is not None:
            states.fill_(self.state.scratch)
        for i, w in enumerate(works):
            pos = w.start
            used = w.pages[: pos // ps + 1]
            ids[i], positions[i], ctx[i] = w.tokens[0], pos + w.rope_delta, pos + 1
            slots[i] = w.pages[pos // ps] * ps + pos % ps
            table[i, :len(used)] = torch.tensor(used, dtype=torch.long)
            if w.state is not None:
                states[i] = w.state.slot

    def run(self, works) -> list[torch.Tensor]:
        """Logits [1, vocab] per work (copies: the static output is overwritten by the next step)."""
        for w in works:  # as the general forward does: the page table learns the cache it indexes
            w.pages.bind(self.kv, w.start, 1)
        pages = max(w.start // self.page_size + 1 for w in works)
        size = bucket if self.padded else int
        rotary = getattr(self.model, "rotary", None)
        top = max(w.start for w in works)
        if rotary is not None and top >= rotary.cos.shape[0]:  # grow the tables outside any graph, then recapture
            rotary._extend(top + 1)
            self.entries.clear()
        # a sequence after images rotates at index + rope_delta: the compiled and C++ steps take one position for its
        # KV slot and its rotation, so such a step runs the static forward below, which is given both
        shifted = any(w.rope_delta for w in works)
        if self.compiled is not None and len(works) == 1 and not shifted:  # one sequence: the compiled CPU step
            logits = self.compiled.run(works[0])
            if logits is not None:
                self.steps += 1
                self._save_states(works)
                return [logits]
        if self.fused is not None and not shifted:  # the CPU's whole step in one C++ call (cpu_fused.py)
            out = self.fused.run(works)
            self.steps += 1
            self._save_states(works)
            return out
        try:
            e = self._entry(size(len(works)), size(pages))
        except Exception as err:  # a capture that fails must not fail the requests: decode eagerly from now on
            return self._give_up(works, f"capturing batch {size(len(works))}, {size(pages)} pages failed: {err}")
        self._fill(e, works)
        e.flat.copy_(e.host)  # blocking: the host tensor is refilled next step
        if self.row_views:
            e.forward.decode.rows = [w.pages.seq_slice(i, 1, w.start + 1, self.runner.device)
                                     for i, w in enumerate(works)]
        if e.graph is not None and e.runs == 0:
            if not self._replay_matches(e, works):
                return self._give_up(works, f"the first replay of batch {e.batch}, {e.pages} pages differs from the "
                                            f"same step run eagerly")
        elif e.graph is not None:
            e.graph.replay()
        else:
            e.out = self._forward(e)
        e.runs += 1
        self.steps += 1
        self._save_states(works)
        return [e.out[i:i + 1].clone() for i in range(len(works))]

    def _save_states(self, works) -> None:
        for w in works:  # state snapshots this step saves: the state after its one token
            for _, snap in w.state.saves if w.state is not None else ():
                self.state.store(w.state.slot, snap)
