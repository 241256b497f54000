"""POST /v1/responses: the Responses API as Codex CLI and the Agents SDK use it, mapped onto the chat pipeline.
The request is read by engine.server.responses_input (input items, tools of every kind Codex sends), the answer
written by engine.server.responses_reply (output items and their events). With --mcp-config set, hosted `mcp` tools
naming configured servers run here (engine.server.mcp_responses); without it they are left out like other hosted
tools."""
from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from engine.server.chat import SSE_HEADERS, output_constraint, parallel_calls, render
from engine.server.errors import APIError, shown
from engine.server.generation import Choice, sampling_params, submit, unless_disconnected
from engine.server.omitted import omitted_header
from engine.server.parsers import offered_tools
from engine.server.responses_input import ResponseTools, read_input, read_tool_choice, read_tools
from engine.server.responses_reply import ResponseReply
from engine.server.schemas import (MAX_MESSAGES, MAX_TOOLS, Bool, ChatCompletionRequest, Float, TokenCount,
                                   _Open)
from engine.server.state import ServerState
from engine.server.thinking import thinking_constraint

_EFFORT = {"none": "none", "minimal": "minimal", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


class Reasoning(_Open):
    effort: str | None = None  # none, minimal, low, medium, high, xhigh
    summary: str | None = None  # auto, concise, detailed: the reasoning comes as the reasoning item's summary


class ResponsesRequest(_Open):
    """Fields this server has no use for (store, include, prompt_cache_key, service_tier, client_metadata,
    text.verbosity, reasoning.summary, truncation, user, ...) are accepted and ignored."""
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    stream: Bool = False
    max_output_tokens: TokenCount | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: Bool | None = None
    metadata: dict[str, Any] | None = Field(default=None, max_length=MAX_TOOLS)  # OpenAI takes 16 pairs
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}


def to_response_format(text: dict | None) -> dict | None:
    """Responses' text.format (flat) -> chat's response_format (json_schema nested), so it is enforced the same way."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return fmt


def _effort(req: ResponsesRequest) -> str | None:
    effort = req.reasoning.effort if req.reasoning else None
    if effort is None:
        return None
    if effort not in _EFFORT:
        raise APIError(400, f"reasoning.effort must be one of {', '.join(_EFFORT)}, not {shown(effort)}.",
                       param="reasoning.effort")
    return _EFFORT[effort]


def prepare(state: ServerState, req: ResponsesRequest, served: str, tools: ResponseTools):
    """(chat request, prompt token ids, whether the answer starts in reasoning, the images). CPU-bound (a long
    conversation takes seconds to convert and encode): call it in a worker thread."""
    try:
        chat = ChatCompletionRequest(
            model=served, messages=read_input(req.instructions, req.input, tools) or [{"role": "user", "content": ""}],
            tools=tools.chat or None, tool_choice=read_tool_choice(req.tool_choice, tools),
            max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
            reasoning_effort=_effort(req), response_format=to_response_format(req.text),
            parallel_tool_calls=req.parallel_tool_calls)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = "text.format" if first["loc"] and first["loc"][0] == "response_format" else "input"
        raise APIError(400, f"The request cannot be read as a conversation: {where}: {first['msg']}.",
                       param=param) from None
    prompt, in_reasoning, images = render(state, chat, "input")
    return chat, prompt, in_reasoning, images


def check_nothing_stored(req: ResponsesRequest) -> None:
    """A 400 for a request that refers to a stored response or conversation: this server stores none."""
    stored = {"previous_response_id": req.previous_response_id,
              "conversation": (req.model_extra or {}).get("conversation")}
    for field, value in stored.items():
        if value:
            raise APIError(400, f"{field} is not available: this server stores no responses. Send the whole "
                                f"conversation in input (as Codex does with store=false).", param=field)


async def start_reply(req: ResponsesRequest, state: ServerState) -> ResponseReply:
    """The request read, rendered and submitted: its reply, to stream or to collect."""
    served = state.check_model(req.model)
    loaded = state.ready()
    check_nothing_stored(req)
    tools = read_tools(req.tools)
    chat, prompt, in_reasoning, images = await asyncio.to_thread(prepare, state, req, served, tools)
    params = sampling_params(chat, state, len(prompt), loaded.context_window, param="input")
    try:
        params.constraint = await asyncio.to_thread(output_constraint, loaded.tokenizer, chat, in_reasoning)
    except APIError as e:  # the chat pipeline names chat's field; here it is text.format
        e.param = "text.format" if e.param == "response_format" else e.param
        raise
    params.constraint = thinking_constraint(state, loaded.tokenizer, chat.reasoning_effort, params.max_tokens,
                                            in_reasoning, params.constraint)
    streams = submit(state, prompt, params, 1, param="input", images=images)
    reasoning = "<think>" in (loaded.tokenizer.chat_template or "")
    choice = Choice(0, loaded.tokenizer, [], reasoning=reasoning, starts_in_reasoning=in_reasoning,
                    tool_names=offered_tools(chat.tools, chat.tool_choice),
                    parallel_calls=parallel_calls(chat))
    return ResponseReply(req, streams, choice, len(prompt), tools)


async def responses(req: ResponsesRequest, state: ServerState, request=None):
    reply = await start_reply(req, state)
    headers = omitted_header(reply.tools.omitted)
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    return JSONResponse(await unless_disconnected(request, reply.whole()), headers=headers)
