"""`--spec draft`: a small model with the same tokenizer drafts greedily on its own KV pages."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import NInferError
from engine.kv.table import PageList
from engine.memory.geometry import PAGE_SIZE
from engine.ledger.common import DEFAULT_DRAFT_TOKENS
from engine.runner import ModelRunner, Work
from engine.sequence import Sequence
from engine.spec.heads import draft_head, greedy_tokens


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


class DraftModelProposer:
    name = "draft"
    default_tokens = DEFAULT_DRAFT_TOKENS["draft"]

    def __init__(self, model, num_pages: int, kv_dtype, lm_head_draft: bool = False, page_size: int = PAGE_SIZE):
        model.lm_head = draft_head(model.lm_head, lm_head_draft)  # the draft model is ours alone
        self.runner = ModelRunner(model, num_pages, kv_dtype, page_size)
        self.pool = self.runner.pool
        self._seqs: dict[str, _DraftKV] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        active, drafts = [], {}
        for seq, k in requests:
            st = self._seqs.setdefault(seq.request_id, _DraftKV())
            self._sync(seq, st)
            if st.pages.grow(self.pool, len(seq.tokens) + k - 1):
                active.append((seq, k, st))
                drafts[seq.request_id] = []
        works = [Work(seq.tokens[len(st.fed):], len(st.fed), st.pages) for seq, _, st in active]
        for seq, _, st in active:
            st.fed = list(seq.tokens)
        while active:
            rows = torch.cat([r[-1:] for r in self.runner.run(works)])
            still, works = [], []
            for (seq, k, st), token in zip(active, greedy_tokens(rows)):
                out = drafts[seq.request_id]
                out.append(token)
                if len(out) < k:
                    works.append(Work([token], len(st.fed), st.pages))
                    st.fed.append(token)
                    still.append((seq, k, st))
            active = still
        return [drafts.get(seq.request_id, []) for seq, _ in requests]

    def verified(self, seq: Sequence) -> None:
        st = self._seqs.get(seq.request_id)
        if st is not None:
            self._sync(seq, st)

    @staticmethod
    def _sync(seq: Sequence, st: _DraftKV) -> None:
        """Forgets the draft KV of tokens the sequence did not keep (rejected or discarded drafts)."""
        n = 0
        for a, b in zip(st.fed, seq.tokens):
            if a != b:
                break
            n += 1
        del st.fed[n:]
        if n == len(seq.tokens):  # keep at least the last token to feed, so a step always has input
            del st.fed[n - 1:]

    def release(self, seq: Sequence) -> None:
        st = self._seqs.pop(seq.request_id, None)
        if st is not None:
            self.pool.deallocate(st.pages)

    def stats(self) -> dict:
        return {"spec_draft_pages_used": self.pool.num_used, "spec_draft_pages_total": self.pool.num_pages}
