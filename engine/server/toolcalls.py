"""Tool calls in a model's text output, whole or streamed.

Recognised forms (a call counts only when its name is among the offered tools; anything else stays content):
  * Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one JSON object, a list, or several
    objects per block; also Qwen3-Coder's `<tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>`.
  * Bare JSON at the start of the output (or right after a call): `{"name": ..., "arguments"|"parameters": ...}`
    (Llama 3.x) or a list of such objects.
  * A fenced block at a line start, ```json (or ``` with no language), holding such JSON, possibly after text.
  * Mistral: `[TOOL_CALLS][{...}]` or `[TOOL_CALLS]NAME[ARGS]{...}`.

The whole-text parser is the streamer fed everything at once, so both agree however the text is split. The
streamer passes text through as soon as it can no longer be part of a call, holds a possible call until it is
known to be one, and gives it back as content when it turns out not to be one. Content is stripped at both ends.

A call streams once it is known to be real: its name is complete and offered and its arguments have begun
(engine.server.livecalls). Its arguments then come in pieces, written in one canonical form
(engine.server.argstream) whose concatenation is the call's arguments in the whole-text parse too. From then on it
stays a call: if the model's JSON breaks, the arguments end at the last point that closes into a valid object and
the rest of that markup is dropped. A call that repeats an earlier call of the same answer (same name, same
arguments text) is dropped: it is never useful. It is not sent while its arguments are still those of an earlier
call, so a repeat is dropped before any of it was sent. A call cut off at the end of the output (the token budget
ran out) is still a call, with the arguments written so far closed to a valid object; `cut` tells that it happened.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Union

from engine.server.callevents import CallEvents, ToolCall
from engine.server.callsyntax import CALL_FIRST_KEYS, JSON_WS, calls_from_json, json_calls, loads, tag_calls
from engine.server.livecalls import Brackets, LiveCalls, json_head
from engine.server.partialcalls import cut_call
from engine.server.reasoning import partial_tail
from engine.server.xmlcalls import WAIT, xml_head

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
FENCE = "```"
FENCE_LANGS = ("", "json", "tool_call", "tool_calls", "tool_code")
_MISTRAL_NAME_RE = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")
_MISTRAL_PARTIAL_RE = re.compile(r"[A-Za-z0-9_.\-]*(\[(A(R(G(S)?)?)?)?)?")

# ("content", text); a call: ("tool_call", index, id, name, arguments so far) once, then ("tool_args", index,
# more arguments) any number of times, then ("tool_end", index, arguments): the pieces concatenate to the last.
StreamEvent = Union[tuple[str, str], tuple[str, int, str], tuple[str, int, str, str, str]]


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def _at_line_start(text: str, i: int, line_start: bool, start: int = 0) -> bool:
    """Whether only spaces or tabs stand between text[i] and the previous newline (or `start`, itself at a line
    start when line_start)."""
    k = text.rfind("\n", start, i)
    return (k >= 0 or line_start) and not text[(k + 1 if k >= 0 else start):i].strip(" \t")


def _find_fence(text: str, start: int, line_start: bool) -> int:
    i = text.find(FENCE, start)
    while i >= 0 and not _at_line_start(text, i, line_start, start):
        i = text.find(FENCE, i + 1)
    return i


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in JSON_WS:
        i += 1
    return i


def _could_be_call(text: str) -> bool:
    """False once the start of bare JSON shows it is not a call object or list of them (then it is content)."""
    i = 1
    if text[0] == "[":
        i = _skip_ws(text, 1)
        if i == len(text):
            return True
        if text[i] != "{":
            return False
        i += 1
    i = _skip_ws(text, i)
    if i == len(text):
        return True
    if text[i] != '"':
        return False
    end = text.find('"', i + 1)
    key = text[i + 1:end]
    return end < 0 or "\\" in key or key in CALL_FIRST_KEYS


class _JsonScan:
    """Finds where a JSON object or list ends, resuming where the last look stopped as the text grows."""

    def __init__(self, start: int):
        self.start = self.pos = start
        self.brackets = Brackets()
        self.result: int | None = None

    def end(self, text: str) -> int | None:
        """Index just past the value; None while incomplete; -1 when the brackets cannot match."""
        if self.result is None:
            got = self.brackets.feed(text[self.pos:])
            if got is None:
                self.pos = len(text)
            else:
                self.result = got if got < 0 else self.pos + got
        return self.result


_WAIT = object()


class ToolCallStreamer:
    """feed(delta) -> events, flush() -> events (StreamEvent). `tools`: the offered names, or a mapping from each
    name to its parameters schema (which tells the XML format's string parameters from the others); None: any
    name counts. `parallel` False (parallel_tool_calls false): only the first call is kept."""

    def __init__(self, tools: set[str] | dict[str, Any] | None = None, parallel: bool = True):
        self.names = None if tools is None else set(tools)
        self.schemas = dict(tools) if isinstance(tools, dict) else {}
        self.enabled = self.names is None or bool(self.names)
        self.calls = CallEvents(lambda event: self._events.append(event), None if parallel else 1)
        self.tool_calls = self.calls.tool_calls
        self.cut = False          # the last call was cut off (its arguments are partial)
        self._live: LiveCalls | None = None
        self._buf = ""
        self._code = False        # inside a ``` block that is not a tool call
        self._bare_ok = True      # bare JSON may start here: output start or right after a call
        self._line_start = True   # the text consumed so far ends at a line start
        self._started = False     # some non-whitespace content was emitted
        self._ws = ""             # whitespace after the content so far, emitted when more content follows
        self._scan: _JsonScan | None = None
        self._events: list[StreamEvent] = []

    def feed(self, text: str) -> list[StreamEvent]:
        self._buf += text
        return self._run(final=False)

    def flush(self) -> list[StreamEvent]:
        events = self._run(final=True)
        self._ws = ""
        return events

    def _run(self, final: bool) -> list[StreamEvent]:
        self._events = []
        while self._buf and self._step(final):
            pass
        if final and self._live is not None:
            self.cut = self._live.flush_pending(self._buf)
            self._buf = ""
            self._end_live()
        events: list[StreamEvent] = []
        for e in self._events:  # one content event per run of text, one arguments event per run of pieces
            last = events[-1] if events else None
            if e[0] == "content" and last is not None and last[0] == "content":
                events[-1] = ("content", last[1] + e[1])
            elif e[0] == "tool_args" and last is not None and last[0] in ("tool_call", "tool_args") and last[1] == e[1]:
                events[-1] = last[:-1] + (last[-1] + e[2],)
            else:
                events.append(e)
        return events

    def _start_live(self, kind: str, n: int, name: str | None = None) -> bool:
        self._buf, self._scan = self._buf[n:], None
        self._live = LiveCalls(kind, self.calls, self.names, self.schemas, name)
        return True

    def _end_live(self) -> None:
        self._live = None
        self._bare_ok = self._line_start = True

    def _live_step(self, final: bool) -> bool:
        n = self._live.step(self._buf, final)
        self._buf, self._scan = self._buf[n:], None
        if self._live.finished:
            self._end_live()
            return True
        return n > 0

    def _head(self, i: int):
        """Whether a streamable call starts at buf[i]: a tuple when it does, WAIT while unknown, None if not."""
        buf = self._buf
        if i >= len(buf):
            return WAIT
        if buf[i] == "<":
            return xml_head(buf, i, self.names)
        return json_head(buf, i, self.names, in_list=buf[i] == "[")

    # --- consuming the buffer ---
    def _text(self, n: int) -> bool:
        if n <= 0:
            return False
        text, self._buf, self._scan = self._buf[:n], self._buf[n:], None
        if text.strip():
            self._bare_ok = False
        self._line_start = _at_line_start(text, len(text), self._line_start)
        out = self._ws + text
        if not self._started:
            out = out.lstrip()
        body = out.rstrip()
        self._ws = out[len(body):]
        if body:
            self._events.append(("content", body))
            self._started = True
        return True

    def _call(self, calls: list[tuple[str, str]], n: int) -> bool:
        self._buf, self._scan = self._buf[n:], None
        for name, arguments in calls:
            self.calls.whole(name, arguments)
        self._bare_ok = self._line_start = True
        return True

    def _json_at(self, start: int, final: bool):
        """(value, end) for the JSON object or list at buf[start]; _WAIT while incomplete; None if not JSON."""
        if self._scan is None or self._scan.start != start:
            self._scan = _JsonScan(start)
        end = self._scan.end(self._buf)
        if end is None:
            return None if final else _WAIT
        try:
            return (loads(self._buf[start:end]), end) if end > 0 else None
        except ValueError:
            return None

    # --- one step: consume some text (True) or wait for more (False) ---
    def _step(self, final: bool) -> bool:
        buf = self._buf
        if not self.enabled:
            return self._text(len(buf))
        if self._live is not None:
            return self._live_step(final)
        if self._code:
            close = _find_fence(buf, 0, self._line_start)
            if close >= 0:
                self._text(close + len(FENCE))
                self._code = False
                return True
            return self._text(len(buf) - (0 if final else self._fence_tail(buf)))
        if self._bare_ok and buf[0].isspace():
            lead = len(buf) - len(buf.lstrip())
            if lead:
                return self._text(lead)
        found = [(buf.find(TAG_OPEN), self._tag), (buf.find(MISTRAL), self._mistral),
                 (_find_fence(buf, 0, self._line_start), self._fence)]
        if self._bare_ok and buf[0] in "{[":
            found.append((0, self._bare))
        found = [(i, handler) for i, handler in found if i >= 0]
        if found:
            i, handler = min(found, key=lambda f: f[0])
            return handler(final) if i == 0 else self._text(i)
        if final:
            return self._text(len(buf))
        keep = max(self._fence_tail(buf), partial_tail(buf, TAG_OPEN), partial_tail(buf, MISTRAL))
        return self._text(len(buf) - keep)

    def _fence_tail(self, buf: str) -> int:
        for n in (2, 1):
            if buf.endswith("`" * n) and _at_line_start(buf, len(buf) - n, self._line_start):
                return n
        return 0

    def _tag(self, final: bool) -> bool:
        buf, n = self._buf, len(TAG_OPEN)
        head = self._head(_skip_ws(buf, n))
        if isinstance(head, tuple):
            return self._start_live("tag", n)
        if head == WAIT and not final:
            return False
        end = buf.find(TAG_CLOSE, n)
        if end < 0 and not final:
            head = buf[n:].lstrip()
            if not head or head[0] in "{[" or head.startswith("<function=") or "<function=".startswith(head):
                return False
            return self._text(n)  # cannot become a call: the tag is content
        calls = tag_calls(buf[n:end] if end >= 0 else buf[n:], self.names)
        if calls is None and end < 0:
            cut = cut_call(buf[n:], self.names)
            if cut is not None:
                self.cut = True
                return self._call([cut], len(buf))
        if calls is None:
            return self._text(n)
        return self._call(calls, end + len(TAG_CLOSE) if end >= 0 else len(buf))

    def _fence(self, final: bool) -> bool:
        buf = self._buf
        nl = buf.find("\n", len(FENCE))
        lang = buf[len(FENCE):nl if nl >= 0 else len(buf)].strip().lower()
        if nl < 0:
            if not final and any(x.startswith(lang) for x in FENCE_LANGS):
                return False
            return self._open_code()
        if lang not in FENCE_LANGS:
            return self._open_code()
        i = _skip_ws(buf, nl + 1)
        if i < len(buf) and isinstance(json_head(buf, i, self.names, in_list=buf[i] == "["), tuple):
            return self._start_live("fence", nl + 1)
        close = _find_fence(buf, nl + 1, True)
        if close < 0 and not final:
            head = buf[nl + 1:].lstrip()
            return self._open_code() if head and head[0] not in "{[" else False
        calls = json_calls(buf[nl + 1:close] if close >= 0 else buf[nl + 1:], self.names, strict=True)
        if calls is None:
            return self._open_code()
        return self._call(calls, close + len(FENCE) if close >= 0 else len(buf))

    def _open_code(self) -> bool:
        self._text(len(FENCE))
        self._code = True
        return True

    def _bare(self, final: bool) -> bool:
        buf = self._buf
        if not final and MISTRAL.startswith(buf):
            return False
        if not final and not _could_be_call(buf):
            return self._text(1)
        if isinstance(json_head(buf, 0, self.names, in_list=buf[0] == "["), tuple):
            return self._start_live("bare", 0)
        got = self._json_at(0, final)
        if got is _WAIT:
            return False
        calls = None if got is None else calls_from_json(got[0], self.names, strict=True)
        return self._call(calls, got[1]) if calls else self._text(1)

    def _mistral(self, final: bool) -> bool:
        buf = self._buf
        i = _skip_ws(buf, len(MISTRAL))
        if i == len(buf):
            return False if not final else self._text(len(MISTRAL))
        calls = None
        if buf[i] in "{[" and isinstance(json_head(buf, i, self.names, in_list=buf[i] == "["), tuple):
            return self._start_live("mistral", i)
        if buf[i] in "{[":
            got = self._json_at(i, final)
            if got is _WAIT:
                return False
            if got is not None:
                calls, end = calls_from_json(got[0], self.names, strict=False), got[1]
        else:
            m = _MISTRAL_NAME_RE.match(buf, i)
            if m is None:
                if not final and _MISTRAL_PARTIAL_RE.fullmatch(buf, i):
                    return False
                return self._text(len(MISTRAL))
            j = m.end()
            if j == len(buf) and not final:
                return False
            if j < len(buf) and buf[j] == "{" and (self.names is None or m.group(1) in self.names):
                return self._start_live("named", j, m.group(1))
            got = self._json_at(j, final) if j < len(buf) and buf[j] == "{" else None
            if got is _WAIT:
                return False
            if got is not None:
                calls, end = calls_from_json({"name": m.group(1), "arguments": got[0]}, self.names, False), got[1]
        return self._call(calls, end) if calls else self._text(len(MISTRAL))


def parse_tool_calls(text: str, tool_names: set[str] | None = None) -> ParsedOutput:
    """Whole-text parse: the content (tool-call markup removed, stripped, None when empty) and the calls."""
    streamer = ToolCallStreamer(tool_names)
    events = streamer.feed(text) + streamer.flush()
    content = "".join(e[1] for e in events if e[0] == "content")
    return ParsedOutput(content or None, list(streamer.tool_calls))
