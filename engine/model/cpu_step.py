"""The CPU's one-sequence decode step as one compiled graph (--cpu-compile step).

Eager, a decode step of a small model is thousands of small ATen calls around a few low-bit GEMVs, each paying
Python and dispatch overhead. Here `model.final_hidden` (every layer, the KV writes and attention included) is
traced once by torch.compile; inductor fuses the norms, RoPE, casts and residual adds into a few C++ loops between
the GEMVs. The output layer keeps its own kernel (engine/model/head.py), called after the graph.

One graph serves every context length and every sequence: the step's row reads its K/V as one view of the cache
from its first flat slot (`DecodeTable.span`), and both ints are symbolic in the graph. Steps it does not take go
through the runner's static forward as before: more than one sequence, or a sequence whose pages are not
consecutive. The first compile takes about a minute on two cores (inductor caches its part on disk, so later
starts pay less); a machine where it fails (no C++ compiler, an inductor limitation) decodes eagerly, with one
log line saying why.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.batch import DecodeTable, ForwardBatch

log = logging.getLogger("ninfer.model")

WARM_UP_PAGE = 1  # the warm-up step's row starts on this page: a first slot of 0 or 1 would be specialized


class CompiledStep:
    """The compiled decode step of one ModelRunner; `ready()` compiles it (None, or why it cannot be used)."""

    def __init__(self, runner):
        self.runner, self.model, self.kv, self.state = runner, runner.model, runner.kv, runner.state
        self.page_size = runner.page_size
        self.compiles = 0  # graphs inductor built: 1 after ready(), more means a guard failed and it recompiled
        self.steps = 0
        self._fn = None

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        compiled = compile_fx(gm, example_inputs, config_patches={"size_asserts": False})
        self.compiles += 1
        if self.compiles > 1:
            log.warning("the compiled CPU decode step was compiled again (%d times now)", self.compiles)
        return compiled

    def ready(self) -> str | None:
        """Compiles the step by running it once on free pages (their K/V and the state slot are zeroed after)."""
        if not hasattr(self.model, "final_hidden"):
            return f"{type(self.model).__name__} has no final_hidden to compile"
        if self.runner.pool.num_pages < WARM_UP_PAGE + 1:
            return "the KV cache has too few pages for the warm-up step"
        rotary = getattr(self.model, "rotary", None)
        if rotary is not None:  # grown here, not inside the graph: a new table would compile it again
            rotary._extend(self.kv.num_pages * self.page_size + 1)
        from kernels import cpu_compiled
        cpu_compiled.raise_recompile_limit()
        # the model's float constants (norm eps, attention scale) stay constants: as symbols they make dynamo
        # trace the whole step twice
        torch._dynamo.config.specialize_float = True
        compiled = torch.compile(self.model.final_hidden, backend=self._backend, dynamic=True, fullgraph=True)
        slot = self.state.allocate() if self.state is not None else None
        first = WARM_UP_PAGE * self.page_size
        t0 = time.perf_counter()
        try:
            # one eager step first: the layers fill their lazy caches (a low-bit weight's kernel choice) on a first
            # call, and a graph traced before them would be traced again on the next step
            self._fn = self.model.final_hidden
            self._hidden(0, 2, first, slot)
            self._fn = compiled
            for ctx in (3, 4):  # positions of 0 or 1 would be specialized; the second call checks the graph is reused
                self._hidden(0, ctx - 1, first, slot)
        except Exception as e:  # no C++ compiler, a compiler error, an inductor limitation: decode eagerly
            self._fn = None
            return cpu_compiled.compile_error(e)
        finally:
            for i in range(self.kv.num_layers):
                for t in self.kv.layer_tensors(i):
                    t[WARM_UP_PAGE].zero_()
            if slot is not None:
                self.state.zero(slot)
                self.state.free([slot])
        if self.compiles != 1:
            self._fn = None
            return f"it compiled {self.compiles} graphs where one should serve every length"
        log.info("decode steps of one sequence run as one compiled graph (compiled in %.1f s)",
                 time.perf_counter() - t0)
        return None

    def release(self) -> None:
        """Forgets the compiled graph. Dynamo would keep it for the life of the process, in the cache on the model
        class's final_hidden code and in its table of backends (this step's bound method), and with it this runner,
        its pools and the model. (Another model of the class compiled meanwhile recompiles on its next step.)"""
        self._fn = None
        torch._dynamo.reset_code(type(self.model).final_hidden.__code__)
        backends = torch._dynamo.eval_frame.cached_backends
        for key, backend in list(backends.items()):
            if getattr(getattr(backend, "compiler_fn", None), "__self__", None) is self:
                del backends[key]

    def _hidden(self, token: int, position: int, first_slot: int, state_slot: int | None) -> torch.Tensor:
        dev = self.runner.device
        slots = None if state_slot is None else torch.tensor([state_slot], device=dev)
        batch = ForwardBatch(input_ids=torch.tensor([token], device=dev),
                             positions=torch.tensor([position], device=dev),
                             slots=torch.tensor([first_slot + position], device=dev), seqs=[], kv=self.kv,
                             state=self.state, logit_rows=None, max_position=position,
                             decode=DecodeTable(None, None, slots, span=(first_slot, position + 1)))
        with torch.inference_mode():
            if self.compiles == 1 and position >= 2 and first_slot >= 2:
                # the one graph takes every such step (ready() checked it): dynamo's ~3,300 guard checks, most on
                # the model's weights, would only confirm that (about 10% of a step on two cores)
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self._fn(batch)
            return self._fn(batch)

    def run(self, work) -> torch.Tensor | None:
        """Logits [1, vocab] of one decode work, or None when it is not one this step takes (pages not consecutive)."""
        if self._fn is None:
            return None
        s = work.pages.seq_slice(0, 1, work.start + 1, self.runner.device)
        if s.first_page is None:
            return None
        hidden = self._hidden(work.tokens[0], work.start, s.first_page * self.page_size,
                              None if work.state is None else work.state.slot)
        self.steps += 1
        with torch.inference_mode():
            return self.model.lm_head(hidden).float()
