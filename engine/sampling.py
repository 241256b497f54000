"""Per-request sampling: penalties, temperature, top-k, top-p, min-p, greedy, seeded randomness."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from engine.errors import NInferError


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    logprobs: int | None = None  # top-n logprobs to return per token (0 = only the chosen token's)
    extra: dict = field(default_factory=dict)
    # An engine.constrain.Constraint the output must follow (not validated here): a template, never advanced
    # itself; Engine.submit gives each sequence its own fresh() copy, so one params object can serve n choices.
    constraint: object | None = None

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be between 0 and 1"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20"),
            (self.seed is None or -2**63 <= self.seed < 2**63, "seed must be a 64-bit signed integer"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be between -100 and 100"),
        ]
        problems = [msg for ok, msg in checks if not ok]
        if problems:
            raise NInferError("Invalid sampling parameters: " + "; ".join(problems) + ".",
                              "Fix the request's values.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        return g


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """logit_bias; OpenAI presence/frequency penalties over generated tokens; HF-style repetition penalty over all."""
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; returns logits with excluded tokens at -inf."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def target_distribution(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    """What sampling draws the next token from, for one row of logits [V]: the probabilities after penalties and
    filters, or (greedy) the penalized logits, whose argmax is the token."""
    logits = apply_penalties(logits.float().clone(), p, prompt, output)
    return logits if p.greedy else filter_logits(logits, p).softmax(-1)


def sample_token(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                 generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """One token from one row of logits [V]; also returns the model's log-probabilities (before filtering)."""
    logprobs = torch.log_softmax(logits.float(), -1) if p.logprobs is not None else logits
    target = target_distribution(logits, p, prompt, output)
    if p.greedy:
        return int(torch.argmax(target)), logprobs
    token = torch.multinomial(target.cpu(), 1, generator=generator)
    return int(token), logprobs
