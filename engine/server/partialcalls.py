"""Tool calls cut off before they were complete (the token budget ran out inside `<tool_call>`).

Such a call is still a tool call, never markup in the content: the APIs return it with the arguments written so
far, closed to a valid JSON object (so every client can read them), and finish_reason "length" / status
"incomplete" / stop_reason "max_tokens".
"""
from __future__ import annotations

import json
import re
from typing import Any

_JSON_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*(.*))?',
                           re.S)
_XML_FUNC_RE = re.compile(r"\s*<function=([^>\n]+)>(.*)", re.S)
_XML_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|$)", re.S)


def cut_call(inner: str, names: set[str] | None) -> tuple[str, str] | None:
    """(name, arguments JSON) of the incomplete call in the text after `<tool_call>`, when its name is complete
    and offered; None otherwise. The arguments are those written so far, closed to a JSON object."""
    m = _JSON_HEAD_RE.match(inner)
    if m is not None:
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        if names is not None and name not in names:
            return None
        return name, json.dumps(complete_object(m.group(2) or ""), ensure_ascii=False)
    m = _XML_FUNC_RE.match(inner)
    if m is None:
        return None
    name = m.group(1).strip()
    if names is not None and name not in names:
        return None
    args: dict[str, Any] = {}
    for p in _XML_PARAM_RE.finditer(m.group(2)):
        value = p.group(2).strip("\n")
        try:
            args[p.group(1).strip()] = json.loads(value)
        except ValueError:
            args[p.group(1).strip()] = value
    return name, json.dumps(args, ensure_ascii=False)


def _closers(text: str) -> str | None:
    """What closes the strings and brackets open at the end of `text`; None when the brackets do not match."""
    stack: list[str] = []
    in_str = escaped = False
    for c in text:
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if not stack or stack.pop() != c:
                return None
    if escaped:
        return None
    return ('"' if in_str else "") + "".join(reversed(stack))


def complete_object(text: str) -> dict:
    """The JSON object a cut-off JSON text most likely meant: the longest prefix that parses once its open strings
    and brackets are closed (a trailing key without a value is dropped); {} when nothing fits."""
    text = text.strip()
    if not text.startswith("{"):
        return {}
    cuts = [len(text)] + [i for i in range(len(text) - 1, 0, -1) if text[i] in ",{["]
    for end in cuts:
        head = text[:end].rstrip().rstrip(",")
        closers = _closers(head)
        if closers is None:
            continue
        try:
            value = json.loads(head + closers)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}
