"""A tool call's arguments, written out as they are generated.

`ArgsWriter` reads the JSON object a model writes as a call's arguments, a piece at a time, and writes it in one
canonical form: json.dumps's separators (", " and ": "), strings escaped only where JSON needs it (non-ASCII kept),
numbers as Python writes them. Text it has written is never taken back, and the text of a whole object does not
depend on how it was cut into pieces, so the streamed pieces of a call concatenate to exactly the arguments of the
non-streamed answer. To make that possible it holds back what could not be closed into a valid object: a key until
its value starts, a comma until the next value starts, a number or literal until it is complete. So `close()`, at
any point, gives what turns the text written so far into a valid JSON object (used when the output is cut off, or
when the model's JSON turns out broken after pieces were sent).

`canonical_json(value)` writes a decoded value in the same form (for calls read whole).
"""
from __future__ import annotations

import json
import re
from typing import Any

_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = set("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
WS = " \t\r\n"


def escape(text: str) -> str:
    """The inside of a JSON string holding `text` (escaped per character, so pieces escape to pieces)."""
    out = []
    for c in text:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif c < " " or "\ud800" <= c <= "\udfff":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def canonical_json(value: Any) -> str:
    """`value` written as ArgsWriter writes JSON text."""
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{escape(k)}": {canonical_json(v)}' for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(canonical_json(v) for v in value) + "]"
    if isinstance(value, str):
        return f'"{escape(value)}"'
    return json.dumps(value)


def _number(token: str) -> str | None:
    if not _NUMBER_RE.fullmatch(token):
        return None
    value = json.loads(token)
    return None if isinstance(value, float) and value in (float("inf"), float("-inf")) else json.dumps(value)


class ArgsWriter:
    """feed(text) -> canonical text to send; `done` once the object closed (`rest` is the input after it), `bad`
    once the input cannot be JSON (`rest` is the input from the offending character on)."""

    def __init__(self):
        self.stack: list[str] = []   # open "{" / "["
        self.expect = "value"        # value | key | colon | after (a value ended) | first_key | first_value
        self.pending = ""            # canonical text held back until a value starts
        self.token = ""              # a number or literal being read
        self.string: str | None = None  # "key" or "value" while inside a string
        self.key = ""                # the key being read
        self.escape: str | None = None  # an escape sequence being read ("\\", "\\u00")
        self.high: str | None = None    # a high surrogate waiting for its low half
        self.done = self.bad = False
        self.rest = ""
        self.text = ""               # everything written so far

    # --- writing ---
    def _start_value(self, out: list[str], text: str) -> None:
        out.append(self.pending + text)
        self.pending = ""

    def _string_char(self, out: list[str], c: str) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            if "\udc00" <= c <= "\udfff":
                c = chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(c) - 0xDC00))
            else:
                self._emit_char(out, high)
        if "\ud800" <= c <= "\udbff":
            self.high = c
            return
        self._emit_char(out, c)

    def _emit_char(self, out: list[str], c: str) -> None:
        if self.string == "key":
            self.key += c
        else:
            out.append(escape(c))

    def _flush_high(self, out: list[str]) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            self._emit_char(out, high)

    # --- reading ---
    def feed(self, text: str) -> str:
        out: list[str] = []
        for i, c in enumerate(text):
            if self.done or self.bad:
                self.rest = text[i:] if self.done else self.rest
                break
            if not self._char(out, c):
                self.bad, self.rest = True, text[i:]
                break
        else:
            if self.done:
                self.rest = ""
        piece = "".join(out)
        self.text += piece
        return piece

    def _char(self, out: list[str], c: str) -> bool:
        if self.string is not None:
            return self._in_string(out, c)
        if self.token:
            if c in _NUMBER_CHARS and self.token[0] not in "tfn":
                self.token += c
                return True
            if self.token[0] in "tfn" and c.isalpha():
                self.token += c
                if not any(w.startswith(self.token) for w in _LITERALS):
                    return False
                if self.token in _LITERALS:
                    self._start_value(out, self.token)
                    self.token, self.expect = "", "after"
                return True
            if self.token[0] in "tfn":
                return False  # an unfinished literal
            number = _number(self.token)
            if number is None:
                return False
            self._start_value(out, number)
            self.token, self.expect = "", "after"
        if c in WS:
            return True
        expect = self.expect
        if expect in ("value", "first_value"):
            if c == "]" and expect == "first_value":
                return self._close(out, c)
            if c == '"':
                self._start_value(out, '"')
                self.string = "value"
            elif c in "{[":
                if not self.stack and c != "{":
                    return False
                self._start_value(out, c)
                self.stack.append(c)
                self.expect = "first_key" if c == "{" else "first_value"
            elif c in "-0123456789" and self.stack or c in "tfn" and self.stack:
                self.token = c
            else:
                return False
            return True
        if expect in ("key", "first_key"):
            if c == "}" and expect == "first_key":
                return self._close(out, c)
            if c != '"':
                return False
            self.string, self.key = "key", ""
            return True
        if expect == "colon":
            if c != ":":
                return False
            self.pending += ": "
            self.expect = "value"
            return True
        # after a value
        if c == ",":
            self.pending += ", "
            self.expect = "key" if self.stack[-1] == "{" else "value"
            return True
        if c in "}]":
            return self._close(out, c)
        return False

    def _close(self, out: list[str], c: str) -> bool:
        if self.stack[-1] != ("{" if c == "}" else "["):
            return False
        self.stack.pop()
        out.append(c)
        self.expect = "after"
        if not self.stack:
            self.done = True
        return True

    def _in_string(self, out: list[str], c: str) -> bool:
        if self.escape is not None:
            self.escape += c
            if self.escape == "\\u":
                return True
            if self.escape.startswith("\\u"):
                if c not in "0123456789abcdefABCDEF":
                    return False
                if len(self.escape) == 6:
                    self._string_char(out, chr(int(self.escape[2:], 16)))
                    self.escape = None
                return True
            if c not in _SIMPLE:
                return False
            self.escape = None
            self._string_char(out, _SIMPLE[c])
            return True
        if c == "\\":
            self.escape = "\\"
            return True
        if c == '"':
            self._flush_high(out)
            if self.string == "key":
                self.pending += f'"{escape(self.key)}"'
                self.expect = "colon"
            else:
                out.append('"')
                self.expect = "after"
            self.string = None
            return True
        self._string_char(out, c)  # a raw control character is taken as the model meant it, and escaped
        return True

    def close(self) -> str:
        """The text that ends what was written as a valid JSON object (a number the input ended on counts)."""
        if not self.text:
            self.text, self.done = "{}", True
            return "{}"
        out: list[str] = []
        if self.token and self.token[0] not in "tfn" and _number(self.token) is not None:
            self._start_value(out, _number(self.token))
        if self.string == "value":
            self._flush_high(out)
            out.append('"')
        out += ["}" if b == "{" else "]" for b in reversed(self.stack)]
        self.stack, self.done = [], True
        piece = "".join(out)
        self.text += piece
        return piece
