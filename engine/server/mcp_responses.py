"""POST /v1/responses with OpenAI's hosted MCP tool (``{"type": "mcp", "server_label": NAME, ...}``) naming
servers of --mcp-config: the rounds of engine.server.mcp_rounds, written as OpenAI writes them. The output holds one
`mcp_list_tools` item per server, then the items of each round (reasoning, a message) with an `mcp_call` item per
call that ran, before the final round's items; streamed, each item between `response.output_item.added` and
`response.output_item.done`, text deltas as they come. A round's function calls are held back until it is known to
be the last one (calls to the MCP tools ran here and are shown as `mcp_call` items instead)."""
from __future__ import annotations

import json
import time

from engine.server.errors import APIError, shown
from engine.server.mcp_rounds import OVER_LIMIT, Call, StartedRounds, relaxed, rounds, sse_parts
from engine.server.mcp_tools import configured, list_selected, openai_selection
from engine.server.omitted import omitted_header
from engine.server.responses import check_nothing_stored, start_reply
from engine.server.responses_reply import new_id

_CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call")
_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _function(tool) -> dict:
    fn = tool.openai_tool()["function"]
    return {"type": "function", "name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]}


def _tool_choice(choice, named: dict):
    """An `mcp` tool choice as the function choice of its tool (or of any tool, when it names none)."""
    if not (isinstance(choice, dict) and choice.get("type") == "mcp"):
        return choice
    if choice.get("name") is None:
        return "required"
    for exposed, tool in named.items():
        if (tool.server, tool.name) == (choice.get("server_label"), choice["name"]):
            return {"type": "function", "name": exposed}
    raise APIError(400, f"tool_choice names the tool {shown(choice['name'])} of the MCP server "
                        f"{shown(choice.get('server_label'))}, which the request's mcp tools do not offer.",
                   param="tool_choice")


class ResponsesConversation(StartedRounds):
    no_tools = "none"
    relaxed = staticmethod(relaxed)

    def __init__(self, req, state, tools: list[dict]):
        self.req, self.state, self.tools = req, state, tools
        self.items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) \
            else list(req.input)

    async def begin(self, tool_choice) -> None:
        """Starts the first round before the answer does, so what the request cannot do is its status code."""
        update = {"input": self.items, "tools": self.tools, "tool_choice": tool_choice, "stream": True}
        self.pending = await start_reply(self.req.model_copy(update=update), self.state)

    def calls(self) -> list[Call]:
        if self.reply.status == "failed":
            return []
        return [Call(item.get("call_id"), item["name"] if item["type"] == "function_call" and not item.get("namespace")
                     else "", item.get("arguments") or "") for item in self.reply.output if item["type"] in _CALL_ITEMS]

    def add(self, calls: list[Call], done: list[dict | None]) -> None:
        self.items += self.reply.output
        self.items += [{"type": "function_call_output", "call_id": call.id, "output": ran["output"] if ran
                        else OVER_LIMIT} for call, ran in zip(calls, done)]


def mcp_call_item(done: dict) -> dict:
    """A call that ran, as OpenAI's `mcp_call` output item."""
    error = {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": done["output"]}]} \
        if done["error"] else None
    return {"type": "mcp_call", "id": new_id("mcp"), "server_label": done["server_label"], "name": done["name"],
            "arguments": done["arguments_text"], "output": done["output"], "error": error,
            "approval_request_id": None, "status": "failed" if done["error"] else "completed"}


def list_tools_item(server: str, listed: list) -> dict:
    return {"type": "mcp_list_tools", "id": new_id("mcpl"), "server_label": server, "error": None,
            "tools": [{"name": t.name, "description": t.description or None, "input_schema": t.input_schema,
                       "annotations": None} for t in listed]}


class McpResponse:
    """The events and the response of the rounds: one id, one sequence, one output list."""

    def __init__(self, req, state, convo: ResponsesConversation, named: dict, listings: list, choice):
        self.req, self.state, self.convo, self.named, self.listings = req, state, convo, named, listings
        self.choice = choice  # the first round's tool choice
        self.error: APIError | None = None
        self.id, self.created, self.seq = new_id("resp"), int(time.time()), 0
        self.output: list[dict] = []
        self.base: dict = {}  # the latest round's response
        self.usage = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": 0,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}

    def response(self) -> dict:
        """The rounds' response: the last round's (its fields, status and error) as one answer of all rounds."""
        return {**self.base, "id": self.id, "created_at": self.created, "output": self.output,
                "tools": self.req.tools, "tool_choice": self.req.tool_choice or "auto",
                "usage": self.usage if self.base.get("usage") else None}

    def _event(self, kind: str, **body) -> str:
        body = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _item(self, item: dict, status: str | None = None):
        """An item added and done at once (what ran, or a listing)."""
        self.output.append(item)
        at = len(self.output) - 1
        yield self._event("response.output_item.added", output_index=at, item={**item, **(
            {"status": "in_progress", "output": None, "error": None} if status else {})})
        yield self._event("response.output_item.done", output_index=at, item=item)

    def _opening(self, first: dict):
        """At the first round's start: response.created and .in_progress, then the servers' tool listings."""
        if self.base:
            return
        self.base = {**first, "usage": None}
        yield self._event("response.created", response=self.response())
        yield self._event("response.in_progress", response=self.response())
        for server, listed in self.listings:
            yield from self._item(list_tools_item(server, listed))

    def _add_usage(self, usage: dict) -> None:
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            self.usage[key] += usage[key]
        self.usage["input_tokens_details"]["cached_tokens"] += usage["input_tokens_details"]["cached_tokens"]

    def _relay(self, kind: str, body: dict, at: dict[int, int]) -> str:
        """A round's item event under this response's output index and sequence."""
        if kind == "response.output_item.added":
            at[body["output_index"]] = len(self.output)
            self.output.append(body["item"])
        body["output_index"] = at[body["output_index"]]
        if kind == "response.output_item.done":
            self.output[body["output_index"]] = body["item"]
        body.pop("sequence_number", None)
        body.pop("type", None)
        return self._event(kind, **body)

    async def sse(self):
        try:
            async for chunk in self._rounds():
                yield chunk
        except APIError as e:  # a later round the engine could not take (e.g. the results overflow the context)
            self.error = e
            yield self._event("error", code=e.code or "invalid_request_error", message=e.message, param=e.param)
            self.base = {**self.base, "status": "failed", "error": {"code": e.code or "invalid_request_error",
                                                                    "message": e.message}}
        status = self.base.get("status", "failed")
        yield self._event({"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed"), response=self.response())

    async def _rounds(self):
        at: dict[int, int] = {}
        held: list[tuple[str, dict]] = []
        calls_at: set[int] = set()
        async for kind, value in rounds(self.convo, self.state, self.named, self.choice):
            if kind == "ran":
                held = []
                for chunk in self._item(mcp_call_item(value), "running"):
                    yield chunk
                continue
            if kind == "final":
                break
            event, body = sse_parts(value)
            if event == "response.created":
                at, held, calls_at = {}, [], set()
                for chunk in self._opening(body["response"]):
                    yield chunk
            elif event in _TERMINAL:
                self.base = body["response"]
                self._add_usage(body["response"]["usage"])
            elif "output_index" not in body:
                if event == "error":
                    yield self._event(event, **{k: v for k, v in body.items() if k not in ("type", "sequence_number")})
            elif event == "response.output_item.added" and body["item"]["type"] in _CALL_ITEMS or \
                    body["output_index"] in calls_at:
                calls_at.add(body["output_index"])
                held.append((event, body))
            else:
                yield self._relay(event, body, at)
        for event, body in held:  # the last round's calls: the client's to run
            yield self._relay(event, body, at)

    async def whole(self) -> dict:
        async for _ in self.sse():
            pass
        if self.error is not None:
            raise self.error
        failed = self.convo.reply.failed if self.convo.reply is not None else None
        if self.base.get("status", "failed") == "failed":
            if failed is not None and failed.error_status != 500:
                raise APIError(failed.error_status, failed.error, code=failed.error_code)
            raise APIError(500, "The engine failed while generating the response.", code="engine_error")
        return self.response()


async def responses_with_mcp(req, state, request=None):
    from fastapi.responses import JSONResponse, StreamingResponse

    from engine.server.chat import SSE_HEADERS
    from engine.server.generation import unless_disconnected
    state.check_model(req.model)
    check_nothing_stored(req)
    st = configured(state)
    selections = [openai_selection(st, t, f"tools[{i}]", state.settings) for i, t in enumerate(req.tools)
                  if isinstance(t, dict) and t.get("type") == "mcp"]
    named, listings = await list_selected(state, selections)
    tools = [t for t in req.tools if not (isinstance(t, dict) and t.get("type") == "mcp")]
    convo = ResponsesConversation(req, state, tools + [_function(t) for t in named.values()])
    choice = _tool_choice(req.tool_choice, named)
    await convo.begin(choice)
    reply = McpResponse(req, state, convo, named, listings, choice)
    headers = omitted_header(convo.pending.tools.omitted)
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    return JSONResponse(await unless_disconnected(request, reply.whole()), headers=headers)
