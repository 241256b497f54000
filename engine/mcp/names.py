"""MCP tools as OpenAI function tools (Qt-free): each named ``server__tool`` within the function-name rule
(``[A-Za-z0-9_-]``, at most 64 characters), so tools of two servers never collide and a call says whose it is."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

MAX_NAME = 64
SEPARATOR = "__"
_BAD = re.compile(r"[^A-Za-z0-9_-]")


def _clean(text: str) -> str:
    return _BAD.sub("_", text.strip()) or "_"


def exposed_name(server: str, tool: str) -> str:
    """``server__tool`` with characters outside [A-Za-z0-9_-] as "_"; a longer name is cut and ends with a short
    hash of the whole, so it stays unique and stable."""
    name = f"{_clean(server)}{SEPARATOR}{_clean(tool)}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha1(f"{server}\0{tool}".encode()).hexdigest()[:8]
    return name[:MAX_NAME - 9] + "_" + digest


@dataclass
class ToolInfo:
    """One tool of one server, as listed by the server."""
    server: str
    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @property
    def exposed(self) -> str:
        return exposed_name(self.server, self.name)

    def openai_tool(self) -> dict[str, Any]:
        schema = self.input_schema if isinstance(self.input_schema, dict) and self.input_schema else \
            {"type": "object", "properties": {}}
        description = self.description.strip() or f"The tool {self.name} of the MCP server {self.server}."
        return {"type": "function", "function": {"name": self.exposed, "description": description,
                                                 "parameters": schema}}


def index(tools: list[ToolInfo]) -> dict[str, ToolInfo]:
    """Exposed name -> tool (the first of two that would share a name wins; the other is left out)."""
    out: dict[str, ToolInfo] = {}
    for t in tools:
        out.setdefault(t.exposed, t)
    return out
