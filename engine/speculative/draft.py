"""`--spec draft`: a small model with the same tokenizer drafts greedily on its own KV pages.

A draft model with recurrent layers (a small Gated-DeltaNet hybrid for a Qwen3.5 target) cannot forget the state
of drafts the target rejected: each sequence has a state slot and a checkpoint slot holding the state after every
token the target had when drafting began. After a rejection the checkpoint goes back into the slot and the draft
KV rewinds to that point (the accepted drafts are fed again with the next proposal)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import NInferError
from engine.memory.kv.table import PageList
from engine.memory.geometry import PAGE_SIZE
from engine.ledger.common import DEFAULT_DRAFT_TOKENS
from engine.memory.state import SeqState
from engine.runner import ModelRunner, Work
from engine.sequence import Sequence
from engine.speculative.heads import draft_head, greedy_tokens


class TokenizerMismatchError(NInferError):
    pass


def check_same_tokenizer(target, draft, target_name: str, draft_name: str) -> None:
    """Refuses a draft model whose tokenizer maps text to other ids than the target's (its drafts would be
    meaningless ids)."""
    problems = []
    if target.vocab_size != draft.vocab_size:
        problems.append(f"vocabulary sizes differ ({target.vocab_size} vs {draft.vocab_size})")
    else:
        tv, dv = target._hf.get_vocab(), draft._hf.get_vocab()
        differ = [t for t, i in tv.items() if dv.get(t) != i]
        if differ:
            problems.append(f"{len(differ)} tokens have other ids (e.g. {differ[0]!r})")
    if target.eos_token_ids != draft.eos_token_ids and not problems:
        problems.append(f"end-of-sequence ids differ ({sorted(target.eos_token_ids)} vs {sorted(draft.eos_token_ids)})")
    if problems:
        raise TokenizerMismatchError(
            f"The draft model {draft_name} does not share the tokenizer of {target_name}: {'; '.join(problems)}.",
            "Pick a draft model of the same family (same tokenizer), or use --spec ngram, which needs none.")


@dataclass
class _DraftKV:
    pages: PageList = field(default_factory=PageList)
    fed: list[int] = field(default_factory=list)  # tokens whose KV the draft model holds, a prefix of seq.tokens
    state: SeqState | None = None  # a recurrent draft model's state slot (the state after `fed`)
    checkpoint: int | None = None  # its spare slot: the state after the first `base` tokens of `fed`
    base: int = 0


class DraftModelProposer:
    name = "draft"
    default_tokens = DEFAULT_DRAFT_TOKENS["draft"]

    def __init__(self, model, num_pages: int, kv_dtype, lm_head_draft: bool = False, page_size: int = PAGE_SIZE,
                 max_sequences: int = 1):
        """`max_sequences`: the most sequences drafting at once (a recurrent draft model's state slots: two each)."""
        model.lm_head = draft_head(model.lm_head, lm_head_draft)  # the draft model is ours alone
        recurrent = any(spec.kind == "recurrent" for spec in model.cache_specs)
        self.runner = ModelRunner(model, num_pages, kv_dtype, page_size,
                                  state_slots=2 * max_sequences if recurrent else 0)
        self.pool, self.states = self.runner.pool, self.runner.state
        self._seqs: dict[str, _DraftKV] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        active, drafts = [], {}
        for seq, k in requests:
            st = self._seqs.get(seq.request_id) or self._open(seq.request_id)
            if st is None:  # no state slot left: this sequence is not drafted for
                continue
            self._sync(seq, st)
            if st.pages.grow(self.pool, len(seq.tokens) + k - 1):
                active.append((seq, k, st))
                drafts[seq.request_id] = []
        works = [Work(seq.tokens[len(st.fed):], len(st.fed), st.pages, state=st.state) for seq, _, st in active]
        for seq, _, st in active:
            st.fed = list(seq.tokens)
        first = self.runner.run(works) if works else []
        for _, _, st in active:  # the state after every token the target has: drafts roll back to it
            if st.state is not None:
                self.states.copy(st.state.slot, st.checkpoint)
                st.base = len(st.fed)
        while active:
            rows = torch.cat([r[-1:] for r in (first or self.runner.run(works))])
            first = None
            still, works = [], []
            for (seq, k, st), token in zip(active, greedy_tokens(rows)):
                out = drafts[seq.request_id]
                out.append(token)
                if len(out) < k:
                    works.append(Work([token], len(st.fed), st.pages, state=st.state))
                    st.fed.append(token)
                    still.append((seq, k, st))
            active = still
        return [drafts.get(seq.request_id, []) for seq, _ in requests]

    def verified(self, seq: Sequence) -> None:
        st = self._seqs.get(seq.request_id)
        if st is not None:
            self._sync(seq, st)

    def _open(self, request_id: str) -> _DraftKV | None:
        st = _DraftKV()
        if self.states is not None:
            if self.states.num_free < 2:
                return None
            st.state, st.checkpoint = SeqState(self.states.allocate()), self.states.allocate()
        self._seqs[request_id] = st
        return st

    def _sync(self, seq: Sequence, st: _DraftKV) -> None:
        """Forgets the draft KV of tokens the sequence did not keep (rejected or discarded drafts); a recurrent
        state goes back to its checkpoint, or to nothing when it lies beyond what the sequence kept."""
        n = 0
        for a, b in zip(st.fed, seq.tokens):
            if a != b:
                break
            n += 1
        if n == len(seq.tokens):  # keep at least the last token to feed, so a step always has input
            n -= 1
        if st.state is not None and n < len(st.fed):
            if st.base <= n:
                self.states.copy(st.checkpoint, st.state.slot)
                n = st.base
            else:
                self.states.zero(st.state.slot)
                n = 0
        del st.fed[n:]

    def release(self, seq: Sequence) -> None:
        st = self._seqs.pop(seq.request_id, None)
        if st is not None:
            self.pool.deallocate(st.pages)
            if st.state is not None:
                self.states.free([st.state.slot, st.checkpoint])

    def stats(self) -> dict:
        return {"spec_draft_pages_used": self.pool.num_used, "spec_draft_pages_total": self.pool.num_pages}
