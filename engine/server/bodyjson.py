"""A request body's JSON, read so that no body holds the server up and no number reaches a handler that JSON cannot
carry back.

Parsing holds the interpreter for as long as it runs, so its size is bounded before it starts: a cheap pass over the
bytes (in small pieces, so other threads run in between) counts the values outside strings, and a body with more
than MAX_VALUES of them, or more than MAX_CONTAINERS lists and objects, is refused before it is parsed. Numbers are
refused at the door when they are not finite (NaN, Infinity, or a literal beyond a double's range, which Python's
json reads as infinity) or an integer too long for Python to read (more than 4,300 digits).
"""
from __future__ import annotations

import json
import math
import re
import sys

from engine.server.errors import APIError

# The most a request needs is a prompt of token ids as long as a large context (262,144 of them) or a few thousand
# messages; parsing 2**19 values holds the interpreter ~40 ms, 2**17 lists or objects ~20 ms.
MAX_VALUES = 2**19
MAX_CONTAINERS = 2**17
_PIECE = 1 << 16  # bytes scanned at a time (~2 ms each)
_STRING = re.compile(rb'"[^"]*"')  # a string, once escaped quotes and backslashes are gone


def _refuse(message: str, code: str) -> APIError:
    return APIError(400, message, code=code)


def count_values(raw: bytes) -> tuple[int, int]:
    """(values, lists and objects) of a JSON text, counted outside its strings; an upper bound for text that is not
    JSON. Stops counting once either bound is passed."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")  # what is left of a quote delimits a string
    values = containers = start = 0
    while start < len(text) and values <= MAX_VALUES and containers <= MAX_CONTAINERS:
        end = min(start + _PIECE, len(text))
        if text.count(b'"', start, end) % 2:  # the piece ends inside a string: take the string whole
            close = text.find(b'"', end)
            end = len(text) if close < 0 else close + 1
        outside = _STRING.sub(b"", text[start:end])
        opened = outside.count(b"[") + outside.count(b"{")
        containers += opened
        values += opened + outside.count(b",")
        start = end
    return values, containers


def check_size(raw: bytes) -> None:
    """A 400 for a body with more values than any request needs, before parsing it costs anything."""
    values, containers = count_values(raw)
    if values > MAX_VALUES or containers > MAX_CONTAINERS:
        raise _refuse(f"The request body holds more than {MAX_VALUES:,} JSON values or {MAX_CONTAINERS:,} lists and "
                      f"objects, more than any request needs. Send fewer items (prompts, token ids, messages or "
                      f"content parts) per request.", "too_many_values")


def _constant(name: str):
    raise _refuse(f"The request body holds {name}, which is not a JSON number; send finite numbers only.",
                  "invalid_number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _refuse(f"The request body holds the number {text[:40]}{'…' if len(text) > 40 else ''}, beyond the "
                      f"range of a double (about 1.8e308); send finite numbers only.", "invalid_number")
    return value


def loads(raw: bytes):
    """The parsed body; APIError (400) for a non-finite number or an integer too long to read, json.JSONDecodeError,
    UnicodeDecodeError or RecursionError for text that is not JSON."""
    try:
        return json.loads(raw, parse_float=_float, parse_constant=_constant)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError:  # an integer literal past the interpreter's digit limit
        raise _refuse(f"The request body holds an integer of more than {sys.get_int_max_str_digits():,} digits; "
                      f"send numbers within the range of their fields.", "invalid_number") from None
