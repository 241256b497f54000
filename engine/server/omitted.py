"""Hosted tools the server cannot run (web search, code execution, remote MCP, ...): left out of the prompt and
named in the X-NInfer-Omitted-Tools header. A header carries only what was checked to be safe there: a name is a
tool name as both APIs define it (1 to 64 letters, digits, '_' or '-'), so no request text that could break or bloat
the answer's headers reaches them."""
from __future__ import annotations

import re
from typing import Any

from engine.server.errors import APIError, shown

OMITTED_TOOLS_HEADER = "X-NInfer-Omitted-Tools"
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHOWN_IN_HEADER = 16


def hosted_tool_name(name: Any, param: str) -> str:
    """The name of a hosted tool, or a 400 when it is not a tool name."""
    if isinstance(name, str) and _TOOL_NAME.fullmatch(name):
        return name
    raise APIError(400, f"{param} must be a tool name: 1 to 64 letters, digits, '_' or '-' (got {shown(name)}).",
                   param=param)


def omitted_header(names: list[str]) -> dict[str, str]:
    """The header naming the left-out tools (the first 16, then how many more), or none."""
    if not names:
        return {}
    head = ", ".join(names[:_SHOWN_IN_HEADER])
    more = len(names) - _SHOWN_IN_HEADER
    return {OMITTED_TOOLS_HEADER: head + (f", and {more} more" if more > 0 else "")}
