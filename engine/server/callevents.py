"""The tool calls of one answer, as the events the APIs stream: each call gets its index and id when it is
announced, then its argument pieces, then its end. A call that repeats an earlier one (same name, same arguments
text) is dropped; it is held back while its arguments so far are those of an earlier call of that name, so a repeat
is dropped before any of it was sent, and a call is announced the moment it differs."""
from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    @classmethod
    def new(cls, name: str, arguments: str) -> ToolCall:
        return cls(new_call_id(), name, arguments)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


@dataclass
class _Open:
    name: str
    id: str
    text: str = ""
    index: int | None = None  # None while held back (it may still be a repeat)


class CallEvents:
    """begin(name), args(piece)..., end() per call, or whole(name, arguments); each event goes to `emit`:
    ("tool_call", index, id, name, arguments so far), ("tool_args", index, piece), ("tool_end", index, arguments)."""

    def __init__(self, emit: Callable[[tuple], None], most: int | None = None):
        self.emit = emit
        self.most = most  # calls kept at most (1 when parallel calls are off); later ones are dropped unsent
        self.tool_calls: list[ToolCall] = []
        self._seen: dict[str, set[str]] = {}  # name -> the arguments of its calls so far
        self._open: _Open | None = None

    def begin(self, name: str) -> None:
        self._open = _Open(name, new_call_id())
        if self.most is not None and len(self.tool_calls) >= self.most:
            self._open.index = -1  # over the limit: read, never sent
        elif not self._seen.get(name):
            self._announce()

    def _announce(self) -> None:
        call = self._open
        call.index = len(self.tool_calls)
        self.emit(("tool_call", call.index, call.id, call.name, call.text))

    def args(self, piece: str) -> None:
        call = self._open
        call.text += piece
        if call.index == -1:
            return
        if call.index is None:
            if not any(earlier.startswith(call.text) for earlier in self._seen[call.name]):
                self._announce()
        elif piece:
            self.emit(("tool_args", call.index, piece))

    def end(self) -> None:
        call, self._open = self._open, None
        if call.index == -1:
            return
        if call.index is None:
            if call.text in self._seen[call.name]:
                return  # a repeat of an earlier call: nothing of it was sent
            self._announce()
        self._seen.setdefault(call.name, set()).add(call.text)
        self.tool_calls.append(ToolCall(call.id, call.name, call.text))
        self.emit(("tool_end", call.index, call.text))

    def whole(self, name: str, arguments: str) -> None:
        self.begin(name)
        self.args(arguments)
        self.end()
