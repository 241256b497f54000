"""Tool calls cut off before their arguments began (the token budget ran out inside `<tool_call>`, right after the
name). Such a call is still a tool call, never markup in the content: the APIs return it with empty arguments and
finish_reason "length" / status "incomplete" / stop_reason "max_tokens". (A call cut off inside its arguments is
read as it streams, engine.server.livecalls, and keeps the arguments written so far.)
"""
from __future__ import annotations

import json
import re

_JSON_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)


def cut_call(inner: str, names: set[str] | None) -> tuple[str, str] | None:
    """(name, "{}") for the incomplete call in the text after `<tool_call>`, when its name is complete and offered;
    None otherwise."""
    m = _JSON_HEAD_RE.match(inner)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    if names is not None and name not in names:
        return None
    return name, "{}"
