"""Reading tool calls out of complete pieces of model output: JSON call objects (one, a list, or several
separated by whitespace). Each reader gives [(name, arguments JSON)] or None when the text is not entirely calls of
offered tools; the arguments are written in engine.server.argstream's canonical form, as streamed calls are.
(Qwen3-Coder's XML calls are always read as they stream: engine.server.livecalls.)"""
from __future__ import annotations

import json
from typing import Any

from engine.server.argstream import canonical_json

# Keys a bare or fenced call object may start with: anything else (a JSON answer) is content from its first key on.
CALL_FIRST_KEYS = {"name", "arguments", "parameters", "function", "type", "id"}
JSON_WS = " \t\r\n"


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _arguments(value: Any) -> dict | None:
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def calls_from_json(value: Any, names: set[str] | None, strict: bool) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) for each call in a decoded object or list; None unless all of it is calls.
    strict (bare and fenced JSON): each object must start with a call key and carry arguments or parameters."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not item or (strict and next(iter(item)) not in CALL_FIRST_KEYS):
            return None
        if isinstance(item.get("function"), dict):  # the OpenAI shape {"type": "function", "function": {...}}
            item = item["function"]
        name = item.get("name")
        if not isinstance(name, str) or not name or (names is not None and name not in names):
            return None
        key = "arguments" if "arguments" in item else "parameters" if "parameters" in item else None
        if key is None and strict:
            return None
        args = _arguments(item[key] if key else None)
        if args is None:
            return None
        calls.append((name, canonical_json(args)))
    return calls or None


def json_calls(text: str, names: set[str] | None, strict: bool) -> list[tuple[str, str]] | None:
    """Calls from one or more JSON values separated by whitespace."""
    text, pos, calls = text.strip(), 0, []
    while pos < len(text):
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        got = calls_from_json(value, names, strict)
        if got is None:
            return None
        calls += got
        while pos < len(text) and text[pos] in JSON_WS:
            pos += 1
    return calls or None


def tag_calls(inner: str, names: set[str] | None) -> list[tuple[str, str]] | None:
    inner = inner.strip()
    return None if inner.startswith("<function=") else json_calls(inner, names, strict=False)
