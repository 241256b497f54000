"""POST /v1/messages with Anthropic's MCP connector: `mcp_servers` (``{"type": "url", "name": NAME, "url": ...}``,
the older beta's `tool_configuration` narrowing its tools) and, in the newer beta, `mcp_toolset` tools
(``{"type": "mcp_toolset", "mcp_server_name": NAME, "default_config": ..., "configs": ...}``) choosing which
servers' tools the model sees. Only the servers of --mcp-config run: a server is found by its name, its url is not
fetched. The rounds (engine.server.mcp_rounds) are written as Anthropic writes them: each call that ran is an
`mcp_tool_use` block and an `mcp_tool_result` block, before the final round's blocks; streamed, each block between
content_block_start and content_block_stop. A round's tool_use blocks are held back until it is known to be the
last one (calls to the MCP tools ran here and are shown as mcp blocks instead)."""
from __future__ import annotations

import json

from engine.server.errors import APIError, anthropic_error_body, shown
from engine.server.mcp_rounds import OVER_LIMIT, Call, StartedRounds, rounds, sse_parts
from engine.server.mcp_tools import Selection, check_served, configured, list_selected
from engine.server.messages import start_reply
from engine.server.messages_reply import _failure, sse_event
from engine.server.omitted import omitted_header


def _names(value, where: str) -> set[str]:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise APIError(400, f"{where} must be a list of tool names.", param="mcp_servers")
    return set(value)


def _toolset(tool: dict, server, where: str) -> Selection:
    """An mcp_toolset's tools: default_config.enabled for all, configs[name].enabled for one."""
    configs = tool.get("configs") or {}
    if not isinstance(configs, dict):
        raise APIError(400, f"{where}.configs must map tool names to {{\"enabled\": ...}}.", param="tools")
    switch = {name: (c or {}).get("enabled") for name, c in configs.items()}
    if (tool.get("default_config") or {}).get("enabled", True) is False:
        return Selection(server, allowed={n for n, on in switch.items() if on is True})
    return Selection(server, disabled={n for n, on in switch.items() if on is False})


def selections(req, state) -> list[Selection]:
    """The configured servers the request names, with which of their tools the model sees."""
    st = configured(state)
    servers = (req.model_extra or {}).get("mcp_servers") or []
    if not isinstance(servers, list):
        raise APIError(400, "mcp_servers must be a list of {\"type\": \"url\", \"name\": ..., \"url\": ...}.",
                       param="mcp_servers")
    named: dict[str, tuple] = {}
    for i, entry in enumerate(servers):
        where = f"mcp_servers[{i}]"
        if not isinstance(entry, dict) or entry.get("type", "url") != "url":
            raise APIError(400, f"{where} must be {{\"type\": \"url\", \"name\": ..., \"url\": ...}}.",
                           param="mcp_servers")
        named[entry.get("name")] = (check_served(st, entry.get("name"), f"{where}.name", state.settings,
                                                 "mcp_servers"), entry.get("tool_configuration") or {})
    toolsets = [(i, t) for i, t in enumerate(req.tools or []) if isinstance(t, dict) and t.get("type") == "mcp_toolset"]
    out = []
    for i, tool in toolsets:
        name = tool.get("mcp_server_name")
        if name not in named:
            raise APIError(400, f"tools[{i}].mcp_server_name {shown(name)} names no server of mcp_servers "
                                f"({', '.join(map(repr, named)) or 'none'}).", param="tools")
        out.append(_toolset(tool, named[name][0], f"tools[{i}]"))
    if toolsets:
        return out
    for i, (server, config) in enumerate(named.values()):  # the older beta: every server, as configured
        if config.get("enabled", True) is not False:
            allowed = config.get("allowed_tools")
            out.append(Selection(server, None if allowed is None else _names(
                allowed, f"mcp_servers[{i}].tool_configuration.allowed_tools")))
    return out


class MessagesConversation(StartedRounds):
    no_tools = {"type": "none"}

    def __init__(self, req, state, tools: list[dict]):
        self.req, self.state, self.tools = req, state, tools
        self.messages = list(req.messages)
        self.omitted: list[str] = []  # Anthropic's own tool types, left out

    @staticmethod
    def relaxed(choice):
        return {"type": "auto"} if isinstance(choice, dict) and choice.get("type") in ("any", "tool") else choice

    async def begin(self, tool_choice) -> None:
        """Starts the first round before the answer does, so what the request cannot do is its status code."""
        update = {"messages": self.messages, "tools": self.tools or None, "tool_choice": tool_choice, "stream": True}
        self.pending, self.omitted = await start_reply(self.req.model_copy(update=update), self.state)

    def calls(self) -> list[Call]:
        if self.reply.failed:
            return []
        return [Call(b["id"], b["name"], json.dumps(b["input"])) for b in self.reply.content if b["type"] == "tool_use"]

    def add(self, calls: list[Call], done: list[dict | None]) -> None:
        said = [b for b in self.reply.content if b["type"] in ("text", "tool_use") and (b.get("text") or
                                                                                        b["type"] == "tool_use")]
        results = [{"type": "tool_result", "tool_use_id": call.id, "content": ran["output"] if ran else OVER_LIMIT,
                    "is_error": bool(ran and ran["error"])} for call, ran in zip(calls, done)]
        self.messages += [{"role": "assistant", "content": said}, {"role": "user", "content": results}]


def mcp_blocks(done: dict) -> tuple[dict, dict]:
    """A call that ran, as Anthropic's mcp_tool_use and mcp_tool_result blocks."""
    block_id = "mcptoolu_" + (done["id"] or "")[-24:]
    arguments = done["arguments"] if isinstance(done["arguments"], dict) else {}
    return ({"type": "mcp_tool_use", "id": block_id, "name": done["name"], "server_name": done["server_label"],
             "input": arguments},
            {"type": "mcp_tool_result", "tool_use_id": block_id, "is_error": bool(done["error"]),
             "content": [{"type": "text", "text": done["output"]}]})


class McpMessage:
    """The events and the message of the rounds: one id, one list of content blocks."""

    def __init__(self, req, state, convo: MessagesConversation, named: dict):
        self.req, self.state, self.convo, self.named = req, state, convo, named
        self.id: str | None = None
        self.content: list[dict] = []
        self.stop: dict = {"stop_reason": None, "stop_sequence": None}
        self.usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}
        self._round: list[tuple[int, int]] = []  # (round index, index here) of the round's blocks shown so far
        self.error: APIError | None = None

    def message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
                "content": self.content, **self.stop, "usage": self.usage}

    def _block(self, block: dict):
        self.content.append(block)
        at = len(self.content) - 1
        start = {**block, "input": {}} if block["type"] == "mcp_tool_use" else block
        yield sse_event("content_block_start", {"type": "content_block_start", "index": at, "content_block": start})
        if block["type"] == "mcp_tool_use":
            yield sse_event("content_block_delta", {"type": "content_block_delta", "index": at, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": at})

    def _relay(self, kind: str, body: dict) -> str:
        if kind == "content_block_start":
            self._round.append((body["index"], len(self.content) + len(self._round)))
        body["index"] = dict(self._round)[body["index"]]
        return sse_event(kind, body)

    def _settle(self) -> None:
        """The round's shown blocks, as they ended, into the content."""
        self.content += [self.convo.reply.content[i] for i, _ in self._round]
        self._round = []

    def _add_usage(self, usage: dict) -> None:
        for key in ("input_tokens", "output_tokens", "cache_read_input_tokens"):
            self.usage[key] += usage[key]

    async def sse(self):
        try:
            async for chunk in self._rounds():
                yield chunk
        except APIError as e:  # a later round the engine could not take (e.g. the results overflow the context)
            self.error = e
            yield sse_event("error", anthropic_error_body(e.status, e.message))

    async def _rounds(self):
        held: list[tuple[str, dict]] = []
        tool_uses: set[int] = set()
        async for kind, value in rounds(self.convo, self.state, self.named, self.req.tool_choice):
            if kind == "ran":
                self._settle()
                held = []
                for block in mcp_blocks(value):
                    for chunk in self._block(block):
                        yield chunk
                continue
            if kind == "final":
                break
            event, body = sse_parts(value)
            if event == "message_start":
                held, tool_uses = [], set()
                if self.id is None:
                    self.id = body["message"]["id"]
                    yield sse_event(event, {**body, "message": {**self.message(), "content": []}})
                    yield sse_event("ping", {"type": "ping"})
            elif event == "message_delta":
                self.stop = {k: body["delta"][k] for k in ("stop_reason", "stop_sequence")}
                self._add_usage(body["usage"])
            elif event == "error":
                yield value
            elif event.startswith("content_block"):
                if event == "content_block_start" and body["content_block"]["type"] == "tool_use" or \
                        body["index"] in tool_uses:
                    tool_uses.add(body["index"])
                    held.append((event, body))
                else:
                    yield self._relay(event, body)
        if self.convo.reply.failed:
            return
        for event, body in held:  # the last round's tool_use blocks: the client's to run
            yield self._relay(event, body)
        self._settle()
        yield sse_event("message_delta", {"type": "message_delta", "delta": dict(self.stop), "usage": self.usage})
        yield sse_event("message_stop", {"type": "message_stop"})

    async def whole(self) -> dict:
        async for _ in self.sse():
            pass
        if self.error is not None:
            raise self.error
        failed = self.convo.reply.failed
        if failed:
            raise APIError(failed.error_status, _failure(failed), code=failed.error_code)
        return self.message()


async def messages_with_mcp(req, state, request=None):
    from fastapi.responses import JSONResponse, StreamingResponse

    from engine.server.chat import SSE_HEADERS
    from engine.server.generation import unless_disconnected

    state.check_model(req.model)
    if req.max_tokens is None:
        raise APIError(400, "max_tokens is required: the most tokens the answer may have (it is capped to the room "
                            "left in the context).", param="max_tokens")
    named, _ = await list_selected(state, selections(req, state))
    tools = [t for t in req.tools or [] if not (isinstance(t, dict) and t.get("type") == "mcp_toolset")]
    tools += [{"name": exposed, "description": fn["function"]["description"],
               "input_schema": fn["function"]["parameters"]}
              for exposed, fn in ((e, t.openai_tool()) for e, t in named.items())]
    convo = MessagesConversation(req, state, tools)
    await convo.begin(req.tool_choice)
    reply = McpMessage(req, state, convo, named)
    headers = omitted_header(convo.omitted)
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    return JSONResponse(await unless_disconnected(request, reply.whole()), headers=headers)
