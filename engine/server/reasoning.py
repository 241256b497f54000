"""Splits a model's output into reasoning (`<think>...</think>`, as Qwen3 and DeepSeek-R1 write it) and the answer.

Only a `<think>` at the very start of the output (after whitespace) opens reasoning. When the chat template already
put `<think>` in the prompt, the output starts inside the reasoning and only `</think>` appears: pass
`starts_in_reasoning=True` (a repeated `<think>` at the start is then dropped). Streaming never lets part of a tag
through: a tail that could still become one is held back until the next delta or `flush()`. Whitespace around the
reasoning and right after `</think>` is dropped, so the whole-text split and any streaming of the same text agree.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    """feed(text) -> (reasoning_delta, content_delta); flush() -> the same for whatever was held back."""

    def __init__(self, starts_in_reasoning: bool = False):
        self.in_reasoning = starts_in_reasoning
        self._at_start = True          # an opening <think> may still come
        self._buf = ""
        self._reasoning_started = False
        self._ws = ""                  # whitespace at the end of the reasoning so far, emitted if more follows
        self._strip_content = False    # drop the whitespace that follows </think>
        self.saw_reasoning = starts_in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        return self._run(text, final=False)

    def flush(self) -> tuple[str, str]:
        out = self._run("", final=True)
        self._ws = ""
        return out

    def _reasoning(self, text: str, out: list[str]) -> None:
        text = self._ws + text
        if not self._reasoning_started:
            text = text.lstrip()
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            out.append(body)
            self._reasoning_started = True

    def _run(self, text: str, final: bool) -> tuple[str, str]:
        buf = self._buf + text
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._at_start:
                head = buf.lstrip()
                if head.startswith(OPEN):
                    buf = head[len(OPEN):]
                    self.in_reasoning = self.saw_reasoning = True
                    self._at_start = False
                elif OPEN.startswith(head) and not final:
                    break                          # only whitespace or a part of "<think>" so far
                else:
                    self._at_start = False
            elif self.in_reasoning:
                end = buf.find(CLOSE)
                if end >= 0:
                    self._reasoning(buf[:end], reasoning)
                    buf = buf[end + len(CLOSE):]
                    self.in_reasoning, self._ws, self._strip_content = False, "", True
                    continue
                keep = 0 if final else partial_tail(buf, CLOSE)
                self._reasoning(buf[:len(buf) - keep], reasoning)
                buf = buf[len(buf) - keep:]
                break
            else:
                if self._strip_content:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    self._strip_content = False
                content.append(buf)
                buf = ""
        self._buf = buf
        return "".join(reasoning), "".join(content)


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Whole-text split: (reasoning, or None when there is none or it is empty; content)."""
    splitter = ReasoningSplitter(starts_in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    return (r1 + r2) or None, c1 + c2
