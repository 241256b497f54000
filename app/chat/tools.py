"""MCP tools in the chat (Qt-free): which servers a conversation offers the model, the sampling used while tools
are on (Agent mode's), and one turn's tool calls: each asked for approval (Approve once / Always for this tool /
Deny; "always" remembered per server and tool), run through engine/mcp with a time limit, its result appended as a
``tool`` message; at most ``calls_per_turn`` calls in a turn. The servers are those of mcp.json in the app's
config folder (docs/MCP.md); the sessions run on engine/mcp's own thread.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from engine.errors import NInferError
from engine.mcp import config as mcp_config
from engine.mcp.approvals import ALWAYS, APPROVE, DENY, Approvals
from engine.mcp.client import McpError, ToolResult
from engine.mcp.host import McpHost
from engine.mcp.names import ToolInfo

from app import paths
from app.chat.store import Message

DEFAULT_CALLS_PER_TURN = 8
DEFAULT_TIMEOUT_S = 60.0
AGENT_KEYS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")  # what any OpenAI server takes
NINFER_KEYS = ("top_k", "min_p")  # what only NInfer (a server with the mode switch) takes


def mcp_json_path() -> Path:
    return paths.config_dir() / "mcp.json"


def agent_sampling(ninfer: bool = True) -> dict[str, Any]:
    """Agent mode's sampling (resources/modes.toml or the user's copy), for the requests of a turn with tools."""
    from engine.modes import SHIPPED, load_modes
    try:
        agent = load_modes()["agent"]
    except NInferError:  # a broken user copy: the shipped values
        agent = load_modes(SHIPPED)["agent"]
    keys = AGENT_KEYS + (NINFER_KEYS if ninfer else ())
    return {k: agent[k] for k in keys if k in agent}


@dataclass
class Offer:
    """What one turn offers the model: the tools by their exposed name and the servers they come from."""
    tools: dict[str, ToolInfo] = field(default_factory=dict)
    servers: dict[str, mcp_config.ServerConfig] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def openai_tools(self) -> list[dict]:
        return [t.openai_tool() for t in self.tools.values()]


class ChatTools:
    """The chat's MCP side: the configuration file, the limits (app.json ``mcp_limits``), the approvals (app.json
    ``mcp_always``) and the host the sessions run on (started on first use; ``close()`` at quit)."""

    def __init__(self, config, path: Path | None = None):
        self.config = config
        self.path = Path(path) if path else mcp_json_path()
        self.host = McpHost()
        self.approvals = Approvals(config.get("mcp_always"), lambda data: config.set("mcp_always", data))

    # ---- configuration -------------------------------------------------------------------------------------------
    def servers(self) -> dict[str, mcp_config.ServerConfig]:
        """The servers of mcp.json (McpConfigError when it cannot be used)."""
        return mcp_config.load(self.path)

    def save_servers(self, servers: dict[str, mcp_config.ServerConfig]) -> None:
        mcp_config.save(self.path, servers)

    @property
    def calls_per_turn(self) -> int:
        value = (self.config.get("mcp_limits") or {}).get("calls_per_turn", DEFAULT_CALLS_PER_TURN)
        return value if isinstance(value, int) and value > 0 else DEFAULT_CALLS_PER_TURN

    @property
    def timeout_s(self) -> float:
        value = (self.config.get("mcp_limits") or {}).get("timeout_s", DEFAULT_TIMEOUT_S)
        return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_TIMEOUT_S

    def set_limits(self, calls_per_turn: int, timeout_s: float) -> None:
        self.config.set("mcp_limits", {"calls_per_turn": int(calls_per_turn), "timeout_s": float(timeout_s)})

    # ---- one turn ------------------------------------------------------------------------------------------------
    async def offer(self, chosen: list[str]) -> Offer:
        """The tools of the servers ``chosen`` for the conversation; a server that cannot be listed is left out and
        said in ``problems`` (the turn goes on with the others)."""
        offer = Offer()
        if not chosen:
            return offer
        try:
            servers = self.servers()
        except mcp_config.McpConfigError as e:
            offer.problems.append(str(e))
            return offer
        for name in chosen:
            server = servers.get(name)
            if server is None or server.disabled:
                offer.problems.append(f"The MCP server \"{name}\" is no longer in mcp.json (or is disabled): its "
                                      f"tools are off. Pick the servers again under Tools.")
                continue
            try:
                tools = await self.host.list_tools(server, timeout=min(self.timeout_s, 30.0))
            except McpError as e:
                offer.problems.append(f"{e} Its tools are off for this answer.")
                continue
            offer.servers[name] = server
            for t in tools:
                offer.tools.setdefault(t.exposed, t)
        return offer

    async def run(self, offer: Offer, call: dict) -> ToolResult:
        """Runs one approved call; a ToolResult whatever happens."""
        fn = call.get("function") or {}
        tool = offer.tools.get(fn.get("name", ""))
        if tool is None:
            known = ", ".join(offer.tools) or "none"
            return ToolResult(f"There is no tool named {fn.get('name')!r} in this chat (the tools: {known}).",
                              error=True)
        arguments, problem = parse_arguments(fn.get("arguments"))
        if problem:
            return ToolResult(problem, error=True)
        return await self.host.call(offer.servers[tool.server], tool.name, arguments, self.timeout_s)

    def close(self) -> None:
        self.host.close()


def parse_arguments(text: Any) -> tuple[dict, str | None]:
    """A call's arguments (a JSON object as text) -> (dict, None), or ({}, what is wrong)."""
    if isinstance(text, dict):
        return text, None
    try:
        value = json.loads(text or "{}")
    except ValueError as e:
        return {}, f"The arguments are not valid JSON ({e}): {str(text)[:200]!r}. Call the tool again with a JSON object."
    if not isinstance(value, dict):
        return {}, f"The arguments must be a JSON object, not {type(value).__name__}."
    return value, None


def tool_message(call: dict, tool: ToolInfo | None, result: ToolResult, **extra: Any) -> Message:
    """The ``tool`` message answering ``call`` (stats: the call's id, the tool, its server, failed, seconds)."""
    fn = call.get("function") or {}
    stats = {"tool_call_id": call.get("id") or "", "tool": fn.get("name", ""), "failed": result.error, **extra}
    if tool is not None:
        stats.update(server=tool.server, mcp_tool=tool.name)
    if result.seconds is not None:
        stats["seconds"] = round(result.seconds, 3)
    return Message("tool", result.text, stats=stats)


Ask = Callable[[ToolInfo, dict], Awaitable[str]]  # shows the approval, returns APPROVE, ALWAYS or DENY


async def answer_calls(tools: ChatTools, offer: Offer, calls: list[dict], done_so_far: int, ask: Ask,
                       append: Callable[[Message], None]) -> int | None:
    """Answers each of ``calls`` with a tool message (through ``append``): asked, then run or denied. Returns the
    turn's number of calls run so far, or None when the turn must end here (its cap reached). Stopped (cancelled)
    midway, the calls not answered yet are answered "stopped" before the cancellation goes on."""
    pending = list(calls)
    try:
        while pending:
            call = pending[0]
            fn = call.get("function") or {}
            tool = offer.tools.get(fn.get("name", ""))
            if done_so_far >= tools.calls_per_turn:
                for c in pending:
                    append(tool_message(c, offer.tools.get((c.get("function") or {}).get("name", "")), ToolResult(
                        f"Not run: this turn reached its limit of {tools.calls_per_turn} tool calls (raise it in "
                        f"MCP servers…, or send another message to go on).", error=True), capped=True))
                return None
            if tool is not None and not tools.approvals.allowed(tool.server, tool.name):
                arguments, _ = parse_arguments(fn.get("arguments"))
                decision = await ask(tool, arguments)
                if decision == DENY:  # counted too: a model that keeps asking still meets the cap
                    pending.pop(0)
                    done_so_far += 1
                    append(tool_message(call, tool, ToolResult("The user denied this tool call.", error=True),
                                        denied=True))
                    continue
                if decision == ALWAYS:
                    tools.approvals.allow_always(tool.server, tool.name)
            result = await tools.run(offer, call)
            pending.pop(0)
            done_so_far += 1
            append(tool_message(call, tool, result))
        return done_so_far
    except asyncio.CancelledError:
        for c in pending:
            append(tool_message(c, offer.tools.get((c.get("function") or {}).get("name", "")),
                                ToolResult("Stopped: Stop was pressed before this call finished.", error=True),
                                stopped=True))
        raise


__all__ = ["ALWAYS", "APPROVE", "DENY", "ChatTools", "Offer", "agent_sampling", "answer_calls", "tool_message"]
