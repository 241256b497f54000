"""One sequence's memory, and the one manager the scheduler and the speculator ask about it.

A sequence's memory is its attention page table (engine/memory/kv/table.py: a plain page list or a windowed table) and,
when the model has recurrent layers, its state slot (engine/memory/state.py). The MemoryManager pairs the attention
layers' manager (engine/memory/attention.py) with the recurrent layers' (or none, for a pure-attention model), as
llama.cpp's hybrid memory pairs a KV cache with a recurrent memory: callers ask it whether a sequence fits, to grow,
roll back and release it, and never look at which kinds of layer a model has."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.memory.kv.table import PageList, PageTable
from engine.memory.attention import AttentionMemory
from engine.memory.state import SeqState, StateMemory


@dataclass
class SequenceMemory:
    pages: PageTable = field(default_factory=PageList)
    state: SeqState | None = None
    keys: list[bytes] = field(default_factory=list)  # prefix-cache chain keys of its first pages, computed once


class MemoryManager:
    def __init__(self, attention: AttentionMemory, state: StateMemory | None = None):
        self.attention, self.state = attention, state

    def admit(self, seq, recompute: bool = False) -> bool:
        """Memory for a waiting sequence (reused prefix included); False, nothing taken, when it does not fit."""
        if self.state is not None and not self.state.can_admit():
            return False
        if not self.attention.admit(seq, recompute, self.state.usable if self.state is not None else None):
            return False
        if self.state is not None:
            self.state.admit(seq)
        return True

    def grow(self, seq, num_tokens: int) -> bool:
        """Room for num_tokens of the sequence; False, nothing taken, when short (the caller preempts)."""
        return self.attention.grow(seq, num_tokens)

    def reserve_drafts(self, seq, k: int) -> bool:
        """Room to verify k draft tokens after the sequence's tokens, and to roll back any of them."""
        if not self.attention.grow(seq, len(seq.tokens) + k):
            return False
        return self.state is None or self.state.reserve_drafts(seq)

    def before_step(self, seq, start: int, n: int, verify: bool = False) -> None:
        """The step about to compute tokens [start, start + n) of the sequence (`verify`: the last known token and
        drafts, which may be rolled back)."""
        if self.state is not None:
            self.state.before_step(seq, start, n, verify)

    def computed(self, seq) -> None:
        """After a step advanced seq.num_computed."""
        self.attention.computed(seq)
        if self.state is not None:
            self.state.computed(seq)

    def rollback(self, seq) -> None:
        """After a verification step: memory past the kept tokens (seq.num_computed computed, seq.tokens held) is
        given back. A recurrent state cannot drop positions: it returns to its checkpoint and seq.num_computed
        rewinds to the step's start, so the kept tokens are computed again."""
        self.attention.rollback(seq)
        if self.state is not None:
            self.state.rollback(seq)

    def release(self, seq) -> None:
        """Everything the sequence holds goes back (it ended, or is preempted and will be recomputed)."""
        self.attention.release(seq)
        if self.state is not None:
            self.state.release(seq)

    def stats(self) -> dict:
        return dict(self.attention.stats(), **(self.state.stats() if self.state is not None else {}))
