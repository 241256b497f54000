"""Reading tool calls out of complete pieces of model output: JSON call objects (one, a list, or several
separated by whitespace) and Qwen3-Coder's `<function=NAME><parameter=P>V</parameter></function>` XML. Each reader
gives [(name, arguments JSON)] or None when the text is not entirely calls of offered tools."""
from __future__ import annotations

import json
import re
from typing import Any

# Keys a bare or fenced call object may start with: anything else (a JSON answer) is content from its first key on.
CALL_FIRST_KEYS = {"name", "arguments", "parameters", "function", "type", "id"}
JSON_WS = " \t\r\n"
_FUNC_RE = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


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
        calls.append((name, json.dumps(args, ensure_ascii=False)))
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


def _xml_value(raw: str) -> Any:
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    try:
        return loads(raw)
    except ValueError:
        return raw


def _xml_calls(text: str, names: set[str] | None) -> list[tuple[str, str]] | None:
    """Qwen3-Coder: <function=NAME><parameter=P>VALUE</parameter>...</function>, values decoded as JSON when they
    are JSON (numbers, booleans, objects) and kept as text otherwise."""
    text, pos, calls = text.strip(), 0, []
    for m in _FUNC_RE.finditer(text):
        name, body, args, at = m.group(1).strip(), m.group(2), {}, 0
        if text[pos:m.start()].strip() or (names is not None and name not in names):
            return None
        for p in _PARAM_RE.finditer(body):
            if body[at:p.start()].strip():
                return None
            args[p.group(1).strip()] = _xml_value(p.group(2))
            at = p.end()
        if body[at:].strip():
            return None
        calls.append((name, json.dumps(args, ensure_ascii=False)))
        pos = m.end()
    return calls if calls and not text[pos:].strip() else None


def tag_calls(inner: str, names: set[str] | None) -> list[tuple[str, str]] | None:
    inner = inner.strip()
    return _xml_calls(inner, names) if inner.startswith("<function=") else json_calls(inner, names, strict=False)


def canonical(arguments: str) -> str:
    try:
        return json.dumps(loads(arguments), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return arguments
