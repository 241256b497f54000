"""The load-time self-check of lossy formats: a model loaded in another weight format than its file stores (e.g. Q4_1
re-quantized to ternary) or with a quantized KV cache runs a fixed short text, and its next-token distributions are
compared with the file's own weights over an fp32 KV cache: top-1 agreement and KL divergence. A conversion that
destroys the model (top-1 agreement below MIN_TOP1, or mean KL above MAX_KL nats) is refused, naming the numbers,
unless the user insists (--allow-lossy-format); the numbers of every lossy format are logged either way.

The reference is built on the CPU in host memory, in the format the file stores; it is skipped, with a warning
that says why, when it would not fit in half the available RAM."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from engine.errors import NInferError
from engine.memory.geometry import PAGE_SIZE, pages_for
from engine.memory.state import SeqState
from engine.model.formats import weight_format
from engine.model.registry import build_model
from engine.runner import ModelRunner, Work

log = logging.getLogger("ninfer.selfcheck")

MIN_TOP1 = 0.5  # measured on the default model: int8 weights 0.98, k4v4 KV 0.84, ternary weights 0.00
MAX_KL = 1.0  # nats; the same: int8 0.004, k4v4 0.16, ternary 14.1
TEXT = ("The river bends twice before it reaches the old mill, where the water slows and turns green under the "
        "willows. Every spring the miller's daughter counts the ducklings, writes their number on the wall, and "
        "compares it with last year's. In 1911 there were fourteen; in 1912, nine; the year the bridge was rebuilt, "
        "none at all, because the workmen frightened the mothers away. She keeps the list because her grandfather "
        "kept it, and because a number written on a wall is harder to forget than one kept in the head.") * 2
MAX_TOKENS = 256


@dataclass(frozen=True)
class SelfCheck:
    what: str  # e.g. "--weight-dtype ternary (the file stores Q4_1), --kv-dtype k8v4"
    tokens: int
    top1: float
    kl_mean: float
    kl_p99: float

    @property
    def broken(self) -> bool:
        return self.top1 < MIN_TOP1 or self.kl_mean > MAX_KL

    def numbers(self) -> str:
        return (f"top-1 agreement {100 * self.top1:.1f}%, KL divergence mean {self.kl_mean:.3f} nats (p99 "
                f"{self.kl_p99:.3f}) over {self.tokens} tokens")


def lossy_parts(weights, fmt: str, kv_dtype) -> list[str]:
    """What is lossy against the file: linear weights re-quantized to another low-bit format than the file's,
    and a quantized KV cache (named by a string)."""
    parts = []
    stored = weight_format("auto", weights)
    if fmt and fmt != stored:
        kinds = sorted({k.split(" -> ")[0] for n, k in weights.storage.items() if n.endswith("proj.weight")}) \
            or ["dense"]
        parts.append(f"--weight-dtype {fmt} (the file stores {'/'.join(kinds[:3])})")
    if isinstance(kv_dtype, str):
        parts.append(f"--kv-dtype {kv_dtype}")
    return parts


def _reference_bytes(weights) -> int:
    total = 0
    for t in weights.tensors.values():
        total += t.nbytes if hasattr(t, "nbytes") else t.numel() * t.element_size()
    return total


def _logits(model, kv_dtype, ids: list[int]) -> torch.Tensor:
    pages = pages_for(len(ids))
    runner = ModelRunner(model, pages, kv_dtype, PAGE_SIZE, state_slots=1)
    state = SeqState(runner.state.allocate()) if runner.state is not None else None
    return runner.run([Work(ids, 0, runner.pool.allocate(pages), "all", state)])[0].float().cpu()


def run(weights, model, fmt: str, kv_dtype, tokenizer, allow: bool) -> SelfCheck | None:
    """The self-check of `model` (built in `fmt`, run with `kv_dtype`) against the file's own weights, or None when
    nothing is lossy or the reference does not fit (said in the log). Raises NInferError when the format breaks the
    model and `allow` is False."""
    parts = lossy_parts(weights, fmt, kv_dtype)
    if not parts:
        return None
    what = ", ".join(parts)
    need, free = _reference_bytes(weights), psutil.virtual_memory().available
    if need > free // 2:
        log.warning("self-check of %s skipped: the reference copy of the weights needs %.1f GiB of host memory, "
                    "%.1f GiB is free; check this format with ninfer-eval kld before trusting it", what,
                    need / 2**30, free / 2**30)
        return None
    ids = tokenizer.encode(TEXT)[:MAX_TOKENS]
    if len(ids) < 2:  # a test model's toy vocabulary: nothing to compare over
        log.warning("self-check of %s skipped: the tokenizer reads the check's text as %d token(s); check this "
                    "format with ninfer-eval kld before trusting it", what, len(ids))
        return None
    cpu = torch.device("cpu")
    reference = build_model(weights, torch.float32, cpu, weight_format("auto", weights), keep_native=True)
    ref = _logits(reference, torch.float32, ids)
    del reference
    out = _logits(model, kv_dtype, ids)
    lp, lq = ref.log_softmax(-1), out.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    check = SelfCheck(what, len(ids), float((ref.argmax(-1) == out.argmax(-1)).float().mean()),
                      float(kl.mean()), float(kl.quantile(0.99)))
    if check.broken and not allow:
        raise NInferError(f"{what} breaks this model: against the file's own weights on a fixed text, "
                          f"{check.numbers()}.",
                          "Use --weight-dtype auto (the file's own format) or a wider format (int8), or a wider "
                          "--kv-dtype; or add --allow-lossy-format to load it anyway.")
    level = logging.WARNING if check.broken else logging.INFO
    log.log(level, "self-check of %s: %s%s", what, check.numbers(),
            " (loaded anyway: --allow-lossy-format)" if check.broken else "")
    return check
