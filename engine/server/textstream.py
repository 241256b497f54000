"""Turns a request's token stream into text deltas: incremental detokenization and stop strings."""
from __future__ import annotations


class StopStrings:
    """Cuts the text at the first stop string (which is not emitted) and holds back a tail that could still become
    one, so no part of a stop string ever reaches the client."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.pending + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda h: h[0])
            self.pending = ""
            return buf[:at], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class TextStream:
    """Feed token ids, get (text delta, stopped_by_stop_string)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.detok = tokenizer.detokenizer()
        self.stops = StopStrings(stops)
        self.stopped = False

    def feed(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        text, self.stopped = self.stops.feed(self.detok.add(token_ids))
        return text

    def finish(self) -> str:
        if self.stopped:
            return ""
        text, self.stopped = self.stops.feed(self.detok.flush())
        return text if self.stopped else text + self.stops.flush()
