"""The engine's side of speculation: how many tokens to draft for each decoding sequence (adaptive), their KV
pages, and the counters."""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv.pages import PagePool
from engine.sequence import Sequence

GROW_ABOVE = 0.8  # acceptance (moving average) above which the draft length grows by one, up to the ceiling
SHRINK_BELOW = 0.5  # ... below which it shrinks by one; at zero, drafting pauses
PAUSE_STEPS = (4, 64)  # first and longest pause (in decode steps) once the length reached zero; doubles each time


@dataclass
class SpecState:
    """One sequence's adaptive draft length and its counts."""
    length: int
    rate: float = 1.0  # moving average of the accepted fraction of drafted tokens
    pause: int = 0  # decode steps left without drafting
    next_pause: int = PAUSE_STEPS[0]
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification steps (steps that drafted at least one token)

    def record(self, drafted: int, accepted: int, ceiling: int, adaptive: bool) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        if not adaptive:
            return
        self.rate = 0.7 * self.rate + 0.3 * accepted / drafted
        if self.rate > GROW_ABOVE:
            self.length = min(ceiling, self.length + 1)
            self.next_pause = PAUSE_STEPS[0]
        elif self.rate < SHRINK_BELOW:
            self.length -= 1
            if self.length <= 0:
                self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, PAUSE_STEPS[1])
                self.length, self.rate = 1, 0.5 * (GROW_ABOVE + SHRINK_BELOW)


class Speculator:
    """Wraps a proposer (engine.spec.ngram / draft / mtp) with `--draft-tokens` as the ceiling of each sequence's
    draft length; `adaptive` off keeps the length at the ceiling."""

    def __init__(self, proposer, max_draft: int = 0, adaptive: bool = True):
        self.proposer = proposer
        self.max_draft = max_draft or proposer.default_tokens
        self.adaptive = adaptive
        self.counters = dict(spec_drafted=0, spec_accepted=0, spec_steps=0, spec_emitted=0)

    @property
    def method(self) -> str:
        return self.proposer.name

    def state(self, seq: Sequence) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState(self.max_draft)
        return seq.spec

    @property
    def needs_hidden(self) -> bool:
        """Whether the proposer drafts from the target's hidden states (MTP): then the engine hands them over."""
        return getattr(self.proposer, "needs_hidden", False)

    def _length(self, seq: Sequence) -> int:
        """Tokens to draft for seq now (0 while paused): its adaptive length, within what it may still produce."""
        st = self.state(seq)
        room = min(seq.max_context - len(seq.tokens), seq.params.max_tokens - len(seq.output)) - 1
        return 0 if st.pause else max(0, min(st.length, room))

    def draft(self, decoding: list[Sequence], pool: PagePool) -> dict[str, list[int]]:
        """Drafts for the sequences that decode this step (request id -> tokens), with pages grown to hold them."""
        wanted = []
        for seq in decoding:
            k = self._length(seq)
            if seq.spec.pause:
                seq.spec.pause -= 1
            elif k > 0:
                wanted.append((seq, k))
        if not wanted:
            return {}
        drafts = {}
        for (seq, k), tokens in zip(wanted, self.proposer.propose(wanted)):
            tokens = list(tokens[:k])
            if tokens and pool.grow_to(seq.pages, len(seq.tokens) + len(tokens)):
                drafts[seq.request_id] = tokens
        return drafts

    def observe(self, items) -> None:
        """After a step, for a proposer that needs_hidden: items are (sequence, first position computed, the
        target's last hidden states of the positions it kept)."""
        chain = {seq.request_id: k for seq, _, _ in items
                 if seq.num_computed == len(seq.tokens) - 1 and (k := self._length(seq)) > 0}
        self.proposer.observe(items, chain)

    def verified(self, seq: Sequence, drafted: int, accepted: int, pool: PagePool) -> None:
        """After a verification step: counts, adaptive length, and the pages and proposer state of rejected tokens
        given back."""
        self.state(seq).record(drafted, accepted, self.max_draft, self.adaptive)
        c = self.counters
        c["spec_drafted"] += drafted
        c["spec_accepted"] += accepted
        c["spec_steps"] += 1
        c["spec_emitted"] += accepted + 1
        if seq.pages:
            pool.shrink_to(seq.pages, len(seq.tokens))
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
