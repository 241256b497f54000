"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's last few tokens."""
from __future__ import annotations

from engine.ledger.common import DEFAULT_DRAFT_TOKENS
from engine.sequence import Sequence


class NgramIndex:
    """For each n-gram of the token list (n in min_n..max_n), the end of its latest occurrence that is followed by
    at least one token. Grows as tokens are appended (tokens never change once in the list)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def update(self, tokens: list[int]) -> None:
        for end in range(max(self.indexed, self.min_n), len(tokens)):  # end < len: a continuation exists
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.latest[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram matching the end of tokens, the latest occurrence."""
        self.update(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self.latest.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramProposer:
    """`--spec ngram`: no weights, no KV; free when nothing matches (then nothing is drafted)."""
    name = "ngram"
    default_tokens = DEFAULT_DRAFT_TOKENS["ngram"]

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        out = []
        for seq, k in requests:
            index = self._index.get(seq.request_id)
            if index is None:
                index = self._index[seq.request_id] = NgramIndex(self.min_n, self.max_n)
            out.append(index.lookup(seq.tokens, k))
        return out

    def verified(self, seq: Sequence) -> None:
        pass  # the index only ever holds tokens of seq.tokens, which drafts never enter

    def release(self, seq: Sequence) -> None:
        self._index.pop(seq.request_id, None)

    def stats(self) -> dict:
        return {"spec_tracked_sequences": len(self._index)}
