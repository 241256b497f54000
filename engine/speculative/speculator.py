"""The engine's side of speculation: how many tokens to draft for each decoding sequence (adaptive), the memory
to verify and roll them back, and the counters."""
from __future__ import annotations

from engine.memory.manager import MemoryManager
from engine.sequence import Sequence
from engine.speculative.adaptive import SpecState, StepCosts, best_length

class Speculator:
    """Wraps a proposer (engine.speculative.ngram / draft / mtp) with `--draft-tokens` as the ceiling of each sequence's
    draft length (engine.speculative.adaptive picks the length; `adaptive` off keeps it at the ceiling)."""

    def __init__(self, proposer, max_draft: int = 0, adaptive: bool = True):
        self.proposer = proposer
        self.max_draft = max_draft or proposer.default_tokens
        self.adaptive = adaptive
        self.costs = StepCosts()
        self.counters = dict(spec_drafted=0, spec_accepted=0, spec_steps=0, spec_emitted=0)

    @property
    def method(self) -> str:
        return self.proposer.name

    def state(self, seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState()
        return seq.spec

    @property
    def needs_hidden(self) -> bool:
        """Whether the proposer drafts from the target's hidden states (MTP): then the engine hands them over."""
        return getattr(self.proposer, "needs_hidden", False)

    def _room(self, seq: Sequence) -> int:
        """Draft tokens the sequence may still use: it must end within max_tokens and the context."""
        return min(seq.max_context - len(seq.tokens), seq.params.max_tokens - len(seq.output)) - 1

    def draft(self, decoding: list[Sequence], memory: MemoryManager) -> dict[str, list[int]]:
        """Drafts for the sequences that decode this step (request id -> tokens), with memory reserved to verify
        them and to roll any of them back."""
        if self.adaptive and len(decoding) == 1 and self.costs.needs_base:
            return {}  # one plain step, timed by step_done: the unit the draft lengths are weighed against
        wanted = []
        for seq in decoding:
            room = self._room(seq)
            k = min(self.state(seq).length(self.max_draft, self.costs, self.adaptive), room) if room > 0 else 0
            if k > 0:
                wanted.append((seq, k))
        if not wanted:
            return {}
        drafts = {}
        for (seq, k), tokens in zip(wanted, self.proposer.propose(wanted)):
            tokens = list(tokens[:k])
            if tokens and memory.reserve_drafts(seq, len(tokens)):
                drafts[seq.request_id] = tokens
        return drafts

    def step_done(self, tokens: int, sequences: int, prefill: bool, seconds: float) -> None:
        """The engine's timing of a step: single-sequence decode steps teach the cost of each draft length."""
        if sequences == 1 and not prefill:
            self.costs.record(tokens, seconds)

    def observe(self, items) -> None:
        """After a step, for a proposer that needs_hidden: items are (sequence, first position computed, the
        target's last hidden states of the positions it kept)."""
        chain = {}
        for seq, _, _ in items:
            st = self.state(seq)
            if seq.num_computed == len(seq.tokens) - 1 and not st.pause:
                k = 1 if st.probe else best_length(st.acceptance, self.max_draft, self.costs) if self.adaptive \
                    else self.max_draft
                if min(k, self._room(seq)) > 0:
                    chain[seq.request_id] = min(k, self._room(seq))
        self.proposer.observe(items, chain)

    def verified(self, seq: Sequence, drafted: int, accepted: int, memory: MemoryManager) -> None:
        """After a verification step: counts, adaptive length, and the memory and proposer state of rejected tokens
        given back."""
        self.state(seq).record(drafted, accepted, self.costs if self.adaptive else None, self.max_draft)
        c = self.counters
        c["spec_drafted"] += drafted
        c["spec_accepted"] += accepted
        c["spec_steps"] += 1
        c["spec_emitted"] += accepted + 1
        memory.rollback(seq)
        self.proposer.verified(seq)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def stats(self) -> dict:
        c = dict(self.counters)
        c["spec_method"] = self.method
        c["spec_acceptance"] = c["spec_accepted"] / c["spec_drafted"] if c["spec_drafted"] else 0.0
        c["spec_mean_accepted"] = c["spec_accepted"] / c["spec_steps"] if c["spec_steps"] else 0.0
        c.update(self.proposer.stats())
        return c
