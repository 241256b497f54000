"""Server-side MCP tools (``--mcp-config FILE``): a chat completions request that lists
``{"type": "mcp", "server_label": NAME}`` among its tools gets that configured server's tools, and the server runs
the calls the model makes to them, feeding each result back, until the model answers (or calls a tool of the
client's own, which goes back to the client as usual). The shape is OpenAI's hosted MCP tool; ``allowed_tools``
narrows a server's tools. Calls run without asking: whoever starts the server chose the servers, so
``require_approval`` must be absent or ``"never"``. Off unless --mcp-config is set; loopback only unless an API
key is set. The reply carries what ran in ``mcp_calls``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.loading import is_loopback
from engine.errors import NInferError
from engine.mcp.config import McpConfigError, ServerConfig, load
from engine.mcp.host import McpHost
from engine.mcp.names import ToolInfo, index
from engine.server.errors import APIError, shown

MAX_CALLS = 16  # tool calls one request may run; then the model is asked to answer without tools
CALL_TIMEOUT_S = 60.0


@dataclass
class ServerTools:
    """The servers of one --mcp-config file and their sessions (started on first use)."""
    path: str
    servers: dict[str, ServerConfig]
    host: McpHost = field(default_factory=McpHost)

    def close(self) -> None:
        self.host.close()


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


def mcp_entries(tools: list[dict] | None) -> list[dict]:
    return [t for t in tools or [] if isinstance(t, dict) and t.get("type") == "mcp"]


def _entry_server(tools: ServerTools | None, entry: dict, where: str, settings) -> ServerConfig:
    if tools is None:
        raise APIError(400, f"{where} asks for the MCP server {shown(entry.get('server_label'))}, but this server "
                            "runs no MCP tools: start it with --mcp-config FILE (an mcp.json with mcpServers).",
                       param="tools")
    if not is_loopback(settings.host) and not settings.api_key:
        raise APIError(403, "Server-side MCP tools are served on loopback only unless an API key is set: set "
                            "--api-key, or bind --host 127.0.0.1.", param="tools")
    label = entry.get("server_label")
    if label not in tools.servers:
        raise APIError(400, f"{where}.server_label {shown(label)} is not a server of the MCP configuration; it has "
                            f"{', '.join(map(repr, tools.servers)) or 'none'}.", param="tools")
    if entry.get("require_approval", "never") != "never":
        raise APIError(400, f"{where}.require_approval must be \"never\" (or left out): the server runs the tools of "
                            "its MCP configuration without asking. Run the tools in your client to approve each call.",
                       param="tools")
    allowed = entry.get("allowed_tools")
    if allowed is not None and not (isinstance(allowed, list) and all(isinstance(a, str) for a in allowed)):
        raise APIError(400, f"{where}.allowed_tools must be a list of tool names.", param="tools")
    return tools.servers[label]


async def expand(state, tools: list[dict]) -> tuple[list[dict], dict[str, ToolInfo]]:
    """The request's tools with each MCP entry replaced by its server's tools as function tools, and exposed name ->
    ToolInfo for those."""
    from engine.mcp.client import McpError

    try:
        st = server_tools(state)
    except NInferError as e:
        raise APIError(500, f"The server's MCP configuration cannot be used: {e}", code="mcp_config_error") from None
    out: list[dict] = []
    found: list[ToolInfo] = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type") == "mcp"):
            out.append(tool)
            continue
        server = _entry_server(st, tool, f"tools[{i}]", state.settings)
        try:
            listed = await st.host.list_tools(server)
        except McpError as e:
            raise APIError(502, f"The MCP server {server.name!r} could not list its tools: {e}",
                           code="mcp_server_error") from None
        allowed = tool.get("allowed_tools")
        found += [t for t in listed if allowed is None or t.name in allowed]
    named = index(found)
    return out + [t.openai_tool() for t in named.values()], named


async def run_call(state, tool: ToolInfo, call: dict) -> dict[str, Any]:
    """Runs one call of the model's; what ran, with the text the model reads next."""
    st = state.mcp
    raw = (call.get("function") or {}).get("arguments") or "{}"
    started = time.monotonic()
    try:
        arguments = json.loads(raw)
        if not isinstance(arguments, dict):
            raise ValueError("not an object")
    except ValueError:
        text, error, arguments = f"The arguments are not a JSON object: {raw[:200]}", True, raw
    else:
        result = await st.host.call(st.servers[tool.server], tool.name, arguments, CALL_TIMEOUT_S)
        text, error = result.text, result.error
    return {"id": call.get("id"), "server_label": tool.server, "name": tool.name, "arguments": arguments,
            "output": text, "error": error, "seconds": round(time.monotonic() - started, 3)}


def _add_usage(total: dict | None, usage: dict) -> dict:
    if total is None:
        return json.loads(json.dumps(usage))
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] += usage.get(key, 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if "prompt_tokens_details" in total:
        total["prompt_tokens_details"]["cached_tokens"] += cached
    return total


def _round_request(req, messages: list[dict], tools: list[dict], tool_choice):
    from engine.server.schemas import ChatCompletionRequest

    body = req.model_dump(exclude_none=True, by_alias=True)
    body.update(messages=messages, tools=tools, tool_choice=tool_choice)
    return ChatCompletionRequest.model_validate(body)


async def chat_with_mcp(req, state, request=None):
    """POST /v1/chat/completions with MCP tools: the model's calls to them run here, round after round, until it
    answers; at most MAX_CALLS calls, then one last round without tools."""
    from fastapi.responses import JSONResponse

    from engine.server.generation import unless_disconnected

    if req.stream:
        raise APIError(400, "Server-side MCP tools answer in one body: send stream false (streaming the rounds of "
                            "tool calls is not supported yet), or run the tools in your client.", param="stream")
    if req.n != 1:
        raise APIError(400, "Server-side MCP tools run one conversation: n must be 1.", param="n")
    state.check_model(req.model)
    tools, named = await expand(state, req.tools)
    return JSONResponse(await unless_disconnected(request, _rounds(req, state, tools, named)))


async def _rounds(req, state, tools: list[dict], named: dict[str, ToolInfo]) -> dict:
    from engine.server.chat import prepare_reply

    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    ran: list[dict] = []
    usage = None
    choice = req.tool_choice
    while True:
        last = len(ran) >= MAX_CALLS
        reply = await prepare_reply(_round_request(req, messages, tools, "none" if last else choice), state)
        body = await reply.whole()
        usage = _add_usage(usage, body["usage"])
        message = body["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        if last or not calls or any(c["function"]["name"] not in named for c in calls):
            body["usage"], body["mcp_calls"] = usage, ran
            return body
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        for call in calls:
            if len(ran) < MAX_CALLS:
                done = await run_call(state, named[call["function"]["name"]], call)
                ran.append(done)
                output = done["output"]
            else:
                output = f"Not run: this request reached its limit of {MAX_CALLS} tool calls; answer with what you have."
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        choice = "auto" if choice == "required" or isinstance(choice, dict) else choice
