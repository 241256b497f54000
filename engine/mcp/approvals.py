"""Which tool calls run without asking (Qt-free): "Always for this tool", remembered per server and tool.

The choices are a plain ``{server: [tool, ...]}`` mapping kept wherever the caller keeps settings (the app: its
app.json under ``mcp_always``); ``save`` is called after each change.
"""
from __future__ import annotations

from typing import Any, Callable

APPROVE, ALWAYS, DENY = "approve", "always", "deny"


class Approvals:
    def __init__(self, data: Any = None, save: Callable[[dict[str, list[str]]], None] | None = None):
        self.always: dict[str, list[str]] = {}
        if isinstance(data, dict):
            self.always = {str(server): sorted({str(t) for t in tools}) for server, tools in data.items()
                           if isinstance(tools, list)}
        self._save = save

    def allowed(self, server: str, tool: str) -> bool:
        return tool in self.always.get(server, [])

    def allow_always(self, server: str, tool: str) -> None:
        tools = set(self.always.get(server, [])) | {tool}
        self.always[server] = sorted(tools)
        if self._save is not None:
            self._save(self.to_json())

    def revoke(self, server: str, tool: str | None = None) -> None:
        """Ask again for ``tool`` of ``server`` (or for every tool of it)."""
        if tool is None:
            self.always.pop(server, None)
        else:
            self.always[server] = [t for t in self.always.get(server, []) if t != tool]
            if not self.always[server]:
                self.always.pop(server)
        if self._save is not None:
            self._save(self.to_json())

    def to_json(self) -> dict[str, list[str]]:
        return {server: list(tools) for server, tools in self.always.items()}
