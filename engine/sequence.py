"""One request inside the engine: its tokens, its memory (KV pages, recurrent state), and what it has produced."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.memory.kv.table import PageTable
from engine.memory.manager import SequenceMemory
from engine.model.image_keys import KeyTokens
from engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step: the tokens it added, and whether it ended."""
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    spec_drafted: int = 0  # speculative decoding, so far for this request: tokens drafted, and accepted
    spec_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache (not computed)


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_context: int
    sink: Callable[[RequestOutput], None]
    eos_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    tokens: list[int] = field(init=False)
    memory: SequenceMemory = field(default_factory=SequenceMemory)  # its KV page table and recurrent state
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at its first admission
    generator: torch.Generator = field(init=False)
    spec: object | None = None  # engine.speculative.speculator.SpecState while speculative decoding runs
    images: object | None = None  # engine.model.vision_input.PromptImages of a prompt with images
    _key_tokens: object | None = field(init=False, repr=False)

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.generator = self.params.make_generator()
        self._key_tokens = None if self.images is None else \
            KeyTokens(self.tokens, self.images.image_at.tolist(), self.images.key_ids)

    @property
    def pages(self) -> PageTable:
        """Its attention page table (engine/memory/kv/table.py)."""
        return self.memory.pages

    @pages.setter
    def pages(self, table: PageTable) -> None:
        self.memory.pages = table

    @property
    def rope_delta(self) -> int:
        """Its tokens past the prompt rotate at index + rope_delta (0 without images)."""
        return 0 if self.images is None else self.images.delta

    @property
    def cache_tokens(self):
        """Its tokens as the prefix cache and the state snapshots key them: `tokens`, each image placeholder read as
        an id from that image's content hash (engine/model/image_keys.py), so the same image at the same place
        reuses the pages and a different one never matches. The same positions follow: equal keys up to a page
        mean the same text and the same images (hence grids) before it, which is all the M-RoPE positions of
        those tokens depend on."""
        return self.tokens if self._key_tokens is None else self._key_tokens

    @property
    def to_compute(self) -> int:
        """Tokens whose KV is not yet computed; 1 means the sequence is decoding."""
        return len(self.tokens) - self.num_computed

    def append(self, token: int) -> None:
        self.output.append(token)
        self.tokens.append(token)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        p = self.params
        if not p.ignore_eos and token in self.eos_ids or token in p.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= p.max_tokens or len(self.tokens) >= self.max_context:
            self.finish_reason = "length"
