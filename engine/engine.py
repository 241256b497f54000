"""The engine thread: takes requests from any thread, runs scheduler steps, streams outputs back."""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid

import torch

from engine.constrain import ConstraintError
from engine.config.engine_config import EngineConfig
from engine.errors import NInferError
from engine.model.vision_input import ImagesNotSupportedError
from engine.memory.kv.window import tier_stats
from engine.memory.build import assemble
from engine.runner import ModelRunner, Work
from engine.sampling import SamplingParams, sample_token
from engine.scheduler import Scheduler
from engine.sequence import RequestOutput, Sequence, Status, TokenLogprob
from engine.speculative import Speculator, verify
from engine.stream import RequestStream

log = logging.getLogger("ninfer.engine")


class ContextLengthError(NInferError):
    def __init__(self, prompt_tokens: int, limit: int, what: str):
        self.prompt_tokens, self.limit = prompt_tokens, limit
        super().__init__(f"The prompt has {prompt_tokens} tokens; {what} allows at most {limit - 1} "
                         f"(one token must remain for the answer).",
                         "Shorten the prompt, or raise --max-context / --kv-capacity if memory allows.")


class QueueFullError(NInferError):
    def __init__(self, limit: int):
        super().__init__(f"The server is busy: {limit} requests are already running or waiting.",
                         "Retry in a moment, or raise --max-queue / --max-concurrency.")


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig | None = None, *,
                 eos_ids: frozenset[int] = frozenset(), speculator: Speculator | None = None,
                 state_snapshots: int = 0, vision=None, model_name: str = "this model", **settings):
        """`config` (engine/config/engine_config.py; keyword `settings` change single fields of it): the Engine reads
        max_context (the longest sequence, resolved: not 0), max_concurrency, max_queue, prefill_chunk, the prefix
        and KV-tier settings. `state_snapshots`: recurrent-state snapshots kept for prefix reuse (models with
        recurrent layers; engine/memory/state.py). `vision`: the model's engine.model.vision_input.VisionModel
        (None: a text-only model, which refuses requests with images); `model_name` names it in that refusal."""
        c = self.config = (config or EngineConfig()).replace(**settings)
        if c.max_context < 1:
            raise ValueError("Engine needs the resolved context length (config.max_context >= 1)")
        max_concurrency, max_queue, prefill_chunk = c.max_concurrency, c.max_queue, c.prefill_chunk
        self.runner = runner
        self.pool = runner.pool
        self.sequence_memory = assemble(runner.pools, c, speculative=getattr(speculator, "needs_hidden", False),
                                    state_snapshots=state_snapshots)
        self.memory = self.sequence_memory.manager
        self.kv_reach = self.sequence_memory.reach
        self.scheduler = Scheduler(self.memory, max_concurrency, prefill_chunk)
        self.max_context = c.max_context
        self.eos_ids = eos_ids
        self.speculator = speculator  # speculative decoding (engine.speculative), or None
        self.vision, self.model_name = vision, model_name
        self._commands: queue.Queue = queue.Queue()
        self._abort_requested: set[str] = set()  # request ids; the running step checks them between its layers
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._admitted = threading.Semaphore(max_concurrency + max_queue)  # bounds running + waiting
        self.max_queue = max_queue
        self.on_first_token: list = []  # callbacks(seconds from arrival to first token), called on the engine thread
        self.counters = dict(requests=0, finished=0, aborted=0, errors=0, prefill_tokens=0, decode_tokens=0,
                             prefill_seconds=0.0, decode_seconds=0.0, steps=0)

    @property
    def context_tokens(self) -> int:
        """The longest sequence (prompt and answer) this engine runs: max_context, or the KV reach when shorter."""
        return min(self.max_context, self.kv_reach)

    @property
    def context_limit(self) -> str:
        """What sets context_tokens: "the context length" or the KV tier that limits it."""
        return "the context length" if self.max_context < self.kv_reach else self.sequence_memory.reach_what

    # ---- the API other threads call -------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stops the engine thread: what runs or waits ends with finish reason "abort" (a prompt chunk in progress
        leaves its step at the next layer), then waits up to ``timeout`` s for the thread to end. False when it is
        still running then (it ends after its step)."""
        self._abort_requested.update(list(self._streams))  # seen by a step in progress (Engine._abort_check)
        self._commands.put(("stop", None))
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the engine thread did not stop within %.0f s (it is inside a step)", timeout)
                return False
            self._thread = None
        return True

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
               loop=None, images: list | None = None) -> RequestStream:
        """Queues a request; raises NInferError at once when it can never run. Thread-safe. `images`: the prompt's
        images in order (encoded bytes or Pillow images), each standing in `prompt` as its run of <|image_pad|>
        tokens (engine.model.vision_positions.expand_image_placeholders); preprocessed here, on the caller's
        thread (engine/model/vision_input.py)."""
        params.validate()
        if not prompt:
            raise NInferError("The prompt is empty.", "Send at least one token of input.")
        prepared = self._prepare_images(list(prompt), images) if images is not None else None
        capacity = self.kv_reach
        if len(prompt) >= self.max_context:
            raise ContextLengthError(len(prompt), self.max_context, "the context length")
        if len(prompt) >= capacity:
            raise ContextLengthError(len(prompt), capacity, self.sequence_memory.reach_what)
        if params.constraint is not None:  # the sequence's own grammar state, from the (untouched) template
            params = dataclasses.replace(params, constraint=params.constraint.fresh())
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self.abort, loop)
        # built before a queue slot is taken: a request that fails here holds no slot
        seq = Sequence(request_id, list(prompt), params, min(self.max_context, capacity), stream.push, self.eos_ids,
                       images=prepared)
        if not self._admitted.acquire(blocking=False):
            raise QueueFullError(self.scheduler.max_concurrency + self.max_queue)
        self._commands.put(("submit", (seq, stream)))
        return stream

    def _prepare_images(self, prompt: list[int], images: list):
        """The request's images preprocessed and placed (PromptImages); refused where the model has no vision."""
        if self.vision is None:
            raise ImagesNotSupportedError(self.model_name, "has no vision tower loaded (a text-only model)")
        if self.sequence_memory.tiers is not None:
            raise NInferError("Requests with images do not run with a KV window (--kv-window) in this version.",
                              "Serve the model without --kv-window to send it images.")
        return self.vision.prepare(prompt, images)

    def abort(self, request_id: str) -> None:
        self._abort_requested.add(request_id)  # seen by a step in progress (Engine._abort_check)
        self._commands.put(("abort", request_id))

    def generate(self, prompt: list[int], params: SamplingParams, images: list | None = None) -> list[int]:
        """Blocking convenience: the whole completion's token ids (`images`: as submit's)."""
        return [t for out in self.submit(prompt, params, images=images) for t in out.token_ids]

    def stats(self) -> dict:
        s = self.scheduler
        # pages_free counts idle cached pages too (any allocation may evict them); pages_cached is that part
        return dict(self.counters, running=len(s.running), waiting=len(s.waiting), preemptions=s.preemptions,
                    pages_total=self.pool.num_pages, pages_free=self.pool.num_free, page_size=self.pool.page_size,
                    pages_cached=self.pool.num_cached, **self.memory.stats(), **tier_stats(self.runner.pools.host, self.sequence_memory.tiers, s),
                    **(self.speculator.stats() if self.speculator is not None else {}),
                    **(self.vision.encoder_cache.stats() if self.vision is not None else {}))

    def step(self) -> bool:
        """Runs the engine on the calling thread, for tools and tests (never while the engine thread runs): applies
        the queued requests and aborts, then one step; True while work remains."""
        if self._thread is not None:
            raise RuntimeError("Engine.step() is for an engine whose thread is not running")
        if not self._drain(block=False):
            raise RuntimeError("the engine was asked to stop")
        if self.scheduler.has_work():
            self._step()
        return self.scheduler.has_work()

    # ---- the engine thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                if not self._drain(block=not self.scheduler.has_work()):
                    break
                if self.scheduler.has_work():
                    self._step()
            except Exception as e:  # a failed step must not take the engine down
                log.exception("engine step failed")
                self._fail_all(f"The engine failed during a step: {type(e).__name__}: {e}")
        self._fail_all("The engine is shutting down.", reason="abort")

    def _drain(self, block: bool) -> bool:
        """Applies queued commands; False when asked to stop."""
        try:
            cmd = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            if kind == "submit":
                seq, stream = arg
                self._streams[seq.request_id] = stream
                self.scheduler.add(seq)
                self.counters["requests"] += 1
            elif kind == "abort":
                seq = self.scheduler.find(arg)
                if seq is not None:
                    self._end(seq, "abort")
                self._abort_requested.discard(arg)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan:
            return
        drafts, started = {}, time.perf_counter()
        # not for a sequence with images: a drafter keeps no M-RoPE positions (it would rotate at the index, not at
        # index + rope_delta). Such sequences decode one token a step, so their tokens are those without --spec
        if self.speculator is not None:
            decoding = [seq for seq, n in plan if n == 1 and seq.num_computed == len(seq.tokens) - 1
                        and seq.images is None]
            drafts = self.speculator.draft(decoding, self.memory)
        works = []
        for seq, n in plan:
            start = seq.num_computed
            if seq.request_id in drafts:
                tokens, logits = [seq.tokens[-1], *drafts[seq.request_id]], "all"
            else:
                tokens, logits = seq.tokens[start:start + n], "last" if start + n == len(seq.tokens) else None
            self.memory.before_step(seq, start, len(tokens), verify=seq.request_id in drafts)
            works.append(Work(tokens, start, seq.pages, logits, seq.memory.state,
                              self._abort_check(seq) if n > 1 else None, seq.rope_delta,
                              **self._image_chunk(seq, start, len(tokens))))
        t0 = time.perf_counter()
        logits = self.runner.run(works)
        seconds = time.perf_counter() - t0
        prefill = decode = 0
        hidden = self.runner.model.hidden if self.speculator is not None and self.speculator.needs_hidden else None
        kept, row, chosen = [], 0, []
        for (seq, n), rows, work in zip(plan, logits, works):
            if seq.status is Status.FINISHED:  # aborted during the step: it left it, its memory is back
                continue
            if hidden is not None and seq.images is None:  # MTP keeps no KV of a sequence with images
                kept.append((seq, work.start, row))
            if hidden is not None:
                row += len(work.tokens)
            if rows is None or n > 1:
                prefill += n
            if rows is None:
                seq.num_computed += n
                self.scheduler.computed(seq)
                continue
            draft = drafts.get(seq.request_id, [])
            try:
                emitted = self._choose(seq, rows if draft else rows[-1:], draft)
            except ConstraintError as e:
                self._end(seq, "error", str(e))
                continue
            seq.num_computed += n + len(emitted) - 1  # the KV of the accepted drafts is kept
            self.scheduler.computed(seq)
            decode += len(emitted) if n == 1 else len(emitted) - 1
            chosen.append((seq, emitted, draft))
        self._account(prefill, decode, seconds)  # before any caller can see its request finished
        for seq, emitted, draft in chosen:
            self._emit(seq, emitted, draft)
        if hidden is not None:  # MTP: its KV follows the positions kept, and it drafts for the next step
            self.speculator.observe([(seq, start, hidden[row:row + seq.num_computed - start]) for seq, start, row in kept
                                     if seq.status is Status.RUNNING])
        if self.speculator is not None:  # what the whole step cost (drafting, the forward, verification)
            self.speculator.step_done(sum(len(w.tokens) for w in works), len(works), prefill > 0,
                                      time.perf_counter() - started)

    def _image_chunk(self, seq: Sequence, start: int, n: int) -> dict:
        """A prompt chunk of a sequence with images: its M-RoPE positions and the image rows inside it (the rows,
        from the encoder cache or the tower, are made at the first chunk that holds image tokens: none where a
        reused prefix covers every image); {} for text-only sequences and for steps past the prompt (they rotate
        at index + rope_delta)."""
        images = seq.images
        if images is None or start >= images.positions.shape[1]:
            return {}
        if images.needs_rows(start, n):
            self.vision.embed(images, self.runner.model.dtype, self.runner.device)
        return dict(rope_positions=images.chunk_positions(start, n), image_rows=images.chunk_rows(start, n))

    def _abort_check(self, seq: Sequence):
        """For a prompt chunk: what the runner asks between the layers of the step. Once the sequence's abort was
        requested it ends at once (memory released, its caller told) and its rows leave the rest of the step
        (engine/model/interrupt.py), so a cancel never waits for a long prefill chunk to finish."""
        def aborted() -> bool:
            if seq.request_id not in self._abort_requested:
                return False
            if seq.status is not Status.FINISHED:
                self._end(seq, "abort")
            return True
        return aborted

    def _choose(self, seq: Sequence, rows: torch.Tensor, draft: list[int]) -> list[tuple[int, torch.Tensor]]:
        """The tokens this step adds: one sampled from the last row, or (speculating) the verified drafts plus one;
        under a constraint, from what its grammar allows (logprobs stay the model's)."""
        p = seq.params
        if not draft and p.constraint is None:
            return [sample_token(rows[-1], p, seq.prompt, seq.output, seq.generator)]
        return verify(rows, draft, p, seq.prompt, seq.output, seq.generator, p.constraint)

    def _emit(self, seq: Sequence, emitted: list[tuple[int, torch.Tensor]], draft: list[int]) -> None:
        first = not seq.output
        tokens, logprobs = [], []
        for i, (token, row) in enumerate(emitted):
            seq.append(token)
            tokens.append(token)
            if seq.params.logprobs is not None:
                logprobs.append(_token_logprob(token, row, seq.params.logprobs))
            if i == len(emitted) - 1 and seq.params.constraint is not None and seq.params.constraint.finished:
                seq.finish_reason = "stop"  # the grammar is complete (also when this token reached max_tokens)
            if seq.finish_reason:
                break
        if draft:
            self.speculator.verified(seq, len(draft), len(emitted) - 1, self.memory)
        if first:
            for callback in self.on_first_token:
                callback(seq.first_token_at - seq.arrival)
        out = RequestOutput(seq.request_id, tokens, prompt_tokens=len(seq.prompt), completion_tokens=len(seq.output),
                            logprobs=logprobs if seq.params.logprobs is not None else None,
                            cached_tokens=seq.cached_tokens)
        if seq.spec is not None:
            out.spec_drafted, out.spec_accepted = seq.spec.drafted, seq.spec.accepted
        if seq.finish_reason:  # counted before it leaves the running list: a reader sees it running or counted
            self.counters["finished"] += 1
            self._finish(seq, seq.finish_reason)
            out.finished, out.finish_reason = True, seq.finish_reason
        seq.sink(out)

    def _account(self, prefill: int, decode: int, seconds: float) -> None:
        c = self.counters
        c["steps"] += 1
        c["prefill_tokens"] += prefill
        c["decode_tokens"] += decode
        total = prefill + decode
        if total:
            c["prefill_seconds"] += seconds * prefill / total
            c["decode_seconds"] += seconds * decode / total

    def _release(self, seq: Sequence) -> None:
        if self._streams.pop(seq.request_id, None) is not None:
            self._admitted.release()

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.release(seq)
        self._release(seq)

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Ends a sequence early (abort or error): counted before it leaves the scheduler and its caller sees the
        end."""
        self.counters["errors" if reason == "error" else "aborted"] += 1
        self._finish(seq, reason)
        seq.sink(RequestOutput(seq.request_id, [], True, reason, len(seq.prompt), len(seq.output), error=error))

    def _fail_all(self, message: str, reason: str = "error") -> None:
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._end(seq, reason, message if reason == "error" else None)


def _token_logprob(token: int, logprobs, top_n: int) -> TokenLogprob:
    top = []
    if top_n:
        values, ids = logprobs.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


