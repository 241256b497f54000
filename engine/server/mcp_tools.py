"""Server-side MCP tools (``--mcp-config FILE``): a request that asks for a configured server's tools gets them,
and the server runs the calls the model makes to them, feeding each result back, until the model answers (or calls
a tool of the client's own, which goes back to the client as usual). Chat completions and the Responses API ask
with OpenAI's hosted MCP tool (``{"type": "mcp", "server_label": NAME}``, ``allowed_tools`` narrowing the
server's tools); the Messages API with Anthropic's MCP connector (engine.server.mcp_messages). Only the servers of
the configuration run: a request names one, it never brings its own (a URL it gives must be the configured one's).
Calls run without asking: whoever starts the server chose the servers, so ``require_approval`` must be absent or
``"never"``. Off unless --mcp-config is set; loopback only unless an API key is set. The rounds run in
engine.server.mcp_rounds."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.config.loading import is_loopback
from engine.errors import NInferError
from engine.mcp.config import McpConfigError, ServerConfig, load
from engine.mcp.host import McpHost
from engine.mcp.names import ToolInfo, index
from engine.server.errors import APIError, shown
from engine.server.mcp_rounds import CALL_TIMEOUT_S, MAX_CALLS  # noqa: F401  (the limits, named here too)


@dataclass
class ServerTools:
    """The servers of one --mcp-config file and their sessions (started on first use)."""
    path: str
    servers: dict[str, ServerConfig]
    host: McpHost = field(default_factory=McpHost)

    def close(self) -> None:
        self.host.close()


@dataclass
class Selection:
    """One server a request asks for, and which of its tools (None: all)."""
    server: ServerConfig
    allowed: set[str] | None = None
    disabled: set[str] = field(default_factory=set)


def server_tools(state) -> ServerTools | None:
    """The state's ServerTools for its --mcp-config (read once per file; None when unset)."""
    path = getattr(state.settings, "mcp_config", "") or ""
    current = state.mcp
    if current is not None and current.path == path:
        return current
    if current is not None:
        current.close()
    if path and not Path(path).is_file():
        raise McpConfigError(f"--mcp-config names {path}, which is not a file.",
                             "Point it to an mcp.json with mcpServers, or leave it unset.")
    state.mcp = ServerTools(path, load(Path(path))) if path else None
    return state.mcp


def configured(state) -> ServerTools | None:
    try:
        return server_tools(state)
    except NInferError as e:
        raise APIError(500, f"The server's MCP configuration cannot be used: {e}", code="mcp_config_error") from None


def mcp_entries(tools: list[dict] | None) -> list[dict]:
    return [t for t in tools or [] if isinstance(t, dict) and t.get("type") == "mcp"]


def check_served(tools: ServerTools | None, name, where: str, settings, param: str) -> ServerConfig:
    """The configured server a request names, or the 400 (403 off loopback without a key) saying why not."""
    if tools is None:
        raise APIError(400, f"{where} asks for the MCP server {shown(name)}, but this server runs no MCP tools: "
                            "start it with --mcp-config FILE (an mcp.json with mcpServers).", param=param)
    if not is_loopback(settings.host) and not settings.api_key:
        raise APIError(403, "Server-side MCP tools are served on loopback only unless an API key is set: set "
                            "--api-key, or bind --host 127.0.0.1.", param=param)
    if name not in tools.servers:
        raise APIError(400, f"{where} {shown(name)} is not a server of the MCP configuration; it has "
                            f"{', '.join(map(repr, tools.servers)) or 'none'}. Only configured servers run here.",
                       param=param)
    return tools.servers[name]


def _allowed_tools(entry: dict, where: str) -> set[str] | None:
    allowed = entry.get("allowed_tools")
    if isinstance(allowed, dict):  # {"tool_names": [...], "read_only": ...}
        allowed = allowed.get("tool_names")
    if allowed is not None and not (isinstance(allowed, list) and all(isinstance(a, str) for a in allowed)):
        raise APIError(400, f"{where}.allowed_tools must be a list of tool names (or {{\"tool_names\": [...]}}).",
                       param="tools")
    return None if allowed is None else set(allowed)


def openai_selection(tools: ServerTools | None, entry: dict, where: str, settings) -> Selection:
    """An OpenAI hosted MCP tool entry as the configured server it names."""
    server = check_served(tools, entry.get("server_label"), f"{where}.server_label", settings, "tools")
    url = entry.get("server_url")
    if url is not None and (server.url is None or str(url).rstrip("/") != server.url.rstrip("/")):
        held = f"is configured with the URL {server.url}" if server.url else "runs as a local command"
        raise APIError(400, f"{where}.server_url {shown(url)} is not the URL of the configured server "
                            f"{server.name!r}, which {held}: only the servers of the MCP configuration run here. "
                            "Leave server_url out (server_label chooses the server).", param="tools")
    for key in ("connector_id", "tunnel_id"):
        if entry.get(key) is not None:
            raise APIError(400, f"{where}.{key} is not available: only the servers of the MCP configuration run "
                                "here. Leave it out (server_label chooses the server).", param="tools")
    if entry.get("require_approval", "never") != "never":
        raise APIError(400, f"{where}.require_approval must be \"never\" (or left out): the server runs the tools of "
                            "its MCP configuration without asking. Run the tools in your client to approve each call.",
                       param="tools")
    return Selection(server, _allowed_tools(entry, where))


async def list_selected(state, selections: list[Selection]) -> tuple[dict[str, ToolInfo], list[tuple[str, list]]]:
    """(exposed name -> tool for the selected tools, [(server, every tool it listed)] in request order)."""
    from engine.mcp.client import McpError

    found: list[ToolInfo] = []
    listings: list[tuple[str, list[ToolInfo]]] = []
    for sel in selections:
        try:
            listed = await state.mcp.host.list_tools(sel.server)
        except McpError as e:
            raise APIError(502, f"The MCP server {sel.server.name!r} could not list its tools: {e}",
                           code="mcp_server_error") from None
        listings.append((sel.server.name, listed))
        found += [t for t in listed if (sel.allowed is None or t.name in sel.allowed) and t.name not in sel.disabled]
    return index(found), listings


async def expand(state, tools: list[dict]) -> tuple[list[dict], dict[str, ToolInfo], list[tuple[str, list]]]:
    """The request's tools with each MCP entry replaced by its server's tools as chat function tools; exposed name
    -> ToolInfo for those; and what each server listed."""
    st = configured(state)
    selections = [openai_selection(st, t, f"tools[{i}]", state.settings) for i, t in enumerate(tools)
                  if isinstance(t, dict) and t.get("type") == "mcp"]
    named, listings = await list_selected(state, selections)
    kept = [t for t in tools if not (isinstance(t, dict) and t.get("type") == "mcp")]
    return kept + [t.openai_tool() for t in named.values()], named, listings
