"""Reading tool-call markup while it is generated, so a call's arguments stream as the model writes them.

A block of calls (`<tool_call>...</tool_call>`, a fenced ```json block, bare JSON at the start of the output, or
Mistral's `[TOOL_CALLS]...`) is read once the first call in it is known to be real: its name is complete and
offered, and its arguments have begun (`{"name": NAME, "arguments": {` or Qwen3-Coder's `<function=NAME>`). From
then on the block is committed: each call is given to the sink as it goes (begin, argument pieces, end), in the
canonical form of engine.server.argstream, and whatever the block holds after a call breaks (JSON that stops being
JSON, text where the next call should be) is dropped up to the block's end, the call keeping the arguments sent so
far, closed to a valid object. Calls in a shape that cannot be streamed (the name after the arguments, arguments
given as a string, OpenAI's {"type": "function", "function": ...}) are read whole and given at once.
"""
from __future__ import annotations

import json
import re
from typing import Any

from engine.server.argstream import ArgsWriter
from engine.server.callsyntax import calls_from_json, loads
from engine.server.reasoning import partial_tail
from engine.server.xmlcalls import PARAM_CLOSE, WAIT, Sink, XmlCalls, skip_ws

TAG_CLOSE, FENCE = "</tool_call>", "```"
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*\\?', re.DOTALL)
_NAME, _ARGS_KEY = object(), object()


def json_head(buf: str, i: int, names: set[str] | None, in_list: bool = False):
    """For a call object at buf[i] (or a list of them when in_list): (name, index of the arguments' "{") once
    `{"name": NAME, "arguments": {` is there with NAME offered; WAIT while it may still come; None otherwise."""
    j = skip_ws(buf, i)
    if in_list:
        if j == len(buf):
            return WAIT
        if buf[j] != "[":
            return None
        j += 1
    name = None
    for token in ("{", '"name"', ":", _NAME, ",", _ARGS_KEY, ":", "{"):
        j = skip_ws(buf, j)
        if j == len(buf):
            return WAIT
        if token is _NAME:
            m = _STRING_RE.match(buf, j)
            if m is None:
                return WAIT if _OPEN_STRING_RE.fullmatch(buf, j) else None
            try:
                name = json.loads(m.group())
            except ValueError:
                return None
            if names is not None and name not in names:
                return None
            j = m.end()
            continue
        options = ('"arguments"', '"parameters"') if token is _ARGS_KEY else (token,)
        hit = next((o for o in options if buf.startswith(o, j)), None)
        if hit is None:
            return WAIT if any(o.startswith(buf[j:]) for o in options) else None
        j += len(hit)
    return name, j - 1


class Brackets:
    """The open brackets of raw JSON-like text (strings skipped), to find where a broken value ends."""

    def __init__(self, stack: list[str] | None = None, lenient: bool = False):
        self.stack = stack or []
        self.lenient = lenient  # a closing bracket closes the last one open, whichever it is
        self.in_str = self.escaped = False

    def feed(self, text: str) -> int | None:
        """Index in text just past the bracket that closes the outermost one; -1 on a mismatch; None if open."""
        for j, c in enumerate(text):
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.stack.append("}" if c == "{" else "]")
            elif c in "}]":
                if not self.stack or self.stack.pop() != c and not self.lenient:
                    return -1
                if not self.stack:
                    return j + 1
        return None


class LiveCalls(XmlCalls):
    """step(buf, final) -> characters of buf consumed; `finished` once the block ended; flush() at the end of the
    output. kind: "tag", "fence", "bare", "mistral" (one JSON value each but tag and fence, which may hold several
    values), or "named" (Mistral's NAME[ARGS]{...}: the call began with `name`, the arguments come next)."""

    def __init__(self, kind: str, sink: Sink, names: set[str] | None, schemas: dict[str, Any],
                 name: str | None = None):
        self.kind, self.sink, self.names, self.schemas = kind, sink, names, schemas
        self.finished = False
        self.state = "value"
        self.in_list = False
        self.writer: ArgsWriter | None = None
        self.raw = Brackets(lenient=True) if kind in ("bare", "mistral", "named") else None
        self.extra: Brackets | None = None
        self.function = ""   # the XML call's name
        self.param = ""      # the XML parameter being read
        self.params = 0      # parameters written so far
        self.stripped = False
        if name is not None:
            sink.begin(name)
            self.state, self.writer = "args", ArgsWriter()

    def step(self, buf: str, final: bool) -> int:
        pos = 0
        while pos < len(buf) and not self.finished:
            state = self.state
            new = getattr(self, "_" + state)(buf, pos, final)
            if new is None:
                break
            if self.raw is not None and state != "junk":
                self.raw.feed(buf[pos:new])
            pos = new
        return pos

    def flush(self) -> bool:
        """Ends the block at the end of the output; True when a call was open (it is cut off)."""
        self.finished = True
        if self.state == "args":
            self.sink.args(self.writer.close())
        elif self.state in ("xml", "xml_start", "xml_string", "xml_json"):
            if self.state == "xml_string":
                self.sink.args('"')
            self.sink.args("}")
        else:
            return False
        self.sink.end()
        return True

    def flush_pending(self, rest: str) -> bool:
        """flush() for the text left unread when the output ended: a parameter value waiting for its close."""
        if self.state == "xml_json":
            self._param_value(self._strip_end(rest[:len(rest) - partial_tail(rest, PARAM_CLOSE)]))
            self.state = "xml"
        return self.flush()

    # --- between calls ---
    def _after_value(self):
        self.in_list = False
        if self.kind in ("bare", "mistral", "named"):
            self.finished = True
        self.state = "value"

    def _value(self, buf: str, i: int, final: bool):
        j = skip_ws(buf, i)
        if j == len(buf):
            return j if j > i else None
        if self.kind == "tag":
            if buf.startswith(TAG_CLOSE, j):
                self.finished = True
                return j + len(TAG_CLOSE)
            if TAG_CLOSE.startswith(buf[j:]):
                return j if j > i else None
            if buf[j] == "<":
                self.state = "function"
                return j
        if self.kind == "fence":
            if buf.startswith(FENCE, j):
                self.finished = True
                return j + len(FENCE)
            if FENCE.startswith(buf[j:]):
                return j if j > i else None
        if buf[j] == "{":
            self.state = "object"
        elif buf[j] == "[":
            self.in_list, self.state = True, "list_first"
            return j + 1
        else:
            self.state = "junk"
        return j

    def _list_first(self, buf: str, i: int, final: bool):
        j = skip_ws(buf, i)
        if j == len(buf):
            return j if j > i else None
        if buf[j] == "]":
            self._after_value()
            return j + 1
        self.state = "object" if buf[j] == "{" else "junk"
        return j

    def _list_next(self, buf: str, i: int, final: bool):
        j = skip_ws(buf, i)
        if j == len(buf):
            return j if j > i else None
        if buf[j] == "]":
            self._after_value()
            return j + 1
        if buf[j] == ",":
            self.state = "list_item"
            return j + 1
        self.state = "junk"
        return j

    def _list_item(self, buf: str, i: int, final: bool):
        j = skip_ws(buf, i)
        if j == len(buf):
            return j if j > i else None
        self.state = "object" if buf[j] == "{" else "junk"
        return j

    def _after_object(self):
        if self.in_list:
            self.state = "list_next"
        else:
            self._after_value()

    # --- a JSON call object ---
    def _object(self, buf: str, i: int, final: bool):
        head = json_head(buf, i, self.names)
        if head == WAIT and not final:
            return None
        if head in (WAIT, None):
            self.state = "whole"
            return self._whole(buf, i, final)
        name, args_at = head
        self.sink.begin(name)
        self.state, self.writer = "args", ArgsWriter()
        return args_at

    def _whole(self, buf: str, i: int, final: bool):
        end = Brackets().feed(buf[i:])
        if end is None:
            return None
        calls = None
        if end > 0:
            try:
                calls = calls_from_json(loads(buf[i:i + end]), self.names, strict=self.kind in ("bare", "fence"))
            except ValueError:
                calls = None
        if not calls:
            self.state = "junk"
            return i
        for name, arguments in calls:
            self.sink.whole(name, arguments)
        self._after_object()
        return i + end

    def _args(self, buf: str, i: int, final: bool):
        piece = self.writer.feed(buf[i:])
        if piece:
            self.sink.args(piece)
        used = len(buf) - len(self.writer.rest) if (self.writer.done or self.writer.bad) else len(buf)
        if self.writer.bad:
            self.sink.args(self.writer.close())
            self.sink.end()
            self.state = "junk"
        elif self.writer.done:
            self.sink.end()
            self.state = "named_done" if self.kind == "named" else "tail"
        return used

    def _named_done(self, buf: str, i: int, final: bool):
        self.finished = True
        return i

    def _tail(self, buf: str, i: int, final: bool):
        """After a call's arguments: the rest of its object (extra keys are read past)."""
        j = skip_ws(buf, i)
        if j == len(buf):
            return j if j > i else None
        if buf[j] == "}":
            self._after_object()
            return j + 1
        if buf[j] == ",":
            self.extra, self.state = Brackets(["}"]), "extra"
            return j
        self.state = "junk"
        return j

    def _extra(self, buf: str, i: int, final: bool):
        end = self.extra.feed(buf[i:])
        if end is None:
            return len(buf)
        if end < 0:
            self.state = "junk"
            return i
        self._after_object()
        return i + end

    def _junk(self, buf: str, i: int, final: bool):
        """What is left of a block after a broken call: dropped up to the block's end."""
        if self.kind in ("tag", "fence"):
            close = TAG_CLOSE if self.kind == "tag" else FENCE
            k = buf.find(close, i)
            if k >= 0:
                self.finished = True
                return k + len(close)
            keep = 0 if final else partial_tail(buf, close)
            return len(buf) - keep if len(buf) - keep > i else None
        end = self.raw.feed(buf[i:])
        if end is None:
            return len(buf)
        self.finished = True
        return i + max(end, 0)
