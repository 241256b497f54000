"""POST /v1/responses: the subset of the Responses API that Codex CLI and the Agents SDK use, mapped onto the chat
pipeline (instructions, input items incl. function_call / function_call_output, function tools, streaming events)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from typing import Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from engine.server.chat import SSE_HEADERS, output_constraint, render
from engine.server.errors import APIError
from engine.server.generation import Choice, run_choices, sampling_params, submit, unless_disconnected
from engine.server.parsers import tool_names_for
from engine.server.schemas import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest, _Open
from engine.server.state import ServerState


class Reasoning(_Open):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Open):
    model: str
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
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


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict)
                       and p.get("type") in ("input_text", "output_text", "text", "summary_text"))
    return ""


def to_messages(req: ResponsesRequest) -> list[dict]:
    """Responses input items -> chat messages (function calls become assistant tool_calls, outputs tool messages)."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role must be user, system, developer or assistant.",
                               param=f"input[{i}].role")
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"input[{i}] has type {kind!r}; supported: message, function_call, "
                                "function_call_output, reasoning.", param=f"input[{i}].type")
    return messages


def to_chat_tools(tools: list[dict] | None) -> list[dict] | None:
    out = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}] has type {t.get('type')!r}; only function tools are supported.",
                           param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                      if k in t}})
    return out or None


def to_chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


async def responses(req: ResponsesRequest, state: ServerState, request=None):
    state.check_model(req.model)
    loaded = state.ready()
    if req.previous_response_id:
        raise APIError(400, "previous_response_id is not available: this server stores no responses. Send the "
                            "whole conversation in input (as Codex does with store=false).",
                       param="previous_response_id")
    try:
        chat = ChatCompletionRequest(
            model=req.model, messages=to_messages(req), tools=to_chat_tools(req.tools),
            tool_choice=to_chat_tool_choice(req.tool_choice), max_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p,
            reasoning_effort=req.reasoning.effort if req.reasoning else None,
            response_format=to_response_format(req.text), parallel_tool_calls=req.parallel_tool_calls)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = "text.format" if first["loc"] and first["loc"][0] == "response_format" else "input"
        raise APIError(400, f"The request cannot be read as a conversation: {where}: {first['msg']}.",
                       param=param) from None
    prompt, in_reasoning = render(state, chat)
    params = sampling_params(chat, state, len(prompt), loaded.context_window)
    params.constraint = await asyncio.to_thread(output_constraint, loaded.tokenizer, chat, in_reasoning)
    streams = submit(state, prompt, params, 1)
    reasoning = "<think>" in (loaded.tokenizer.chat_template or "")
    choice = Choice(0, loaded.tokenizer, [], reasoning=reasoning, starts_in_reasoning=in_reasoning,
                    tool_names=tool_names_for(chat.tools, chat.tool_choice))
    reply = _Reply(req, streams, choice, len(prompt))
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await unless_disconnected(request, reply.whole()))


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Reply:
    def __init__(self, req: ResponsesRequest, streams, choice: Choice, prompt_tokens: int):
        self.req, self.streams, self.choice = req, streams, choice
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion = {0: 0}
        self.output: list[dict] = []
        self.status, self.incomplete = "in_progress", None
        self.seq = 0

    def response(self) -> dict:
        out_tokens = self.completion[0]
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "model": self.req.model, "output": self.output, "error": None,
            "incomplete_details": self.incomplete, "instructions": self.req.instructions,
            "tools": self.req.tools or [], "tool_choice": self.req.tool_choice or "auto",
            "parallel_tool_calls": bool(self.req.parallel_tool_calls), "temperature": self.req.temperature,
            "top_p": self.req.top_p, "max_output_tokens": self.req.max_output_tokens, "metadata": {},
            "text": self.req.text or {"format": {"type": "text"}},
            "usage": {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.prompt_tokens + out_tokens},
        }

    def _event(self, kind: str, **body) -> str:
        body = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _finish(self, reason: str | None) -> None:
        self.status = "incomplete" if reason == "length" else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if reason == "length" else None

    async def sse(self):
        """Streams events; text goes into one message item, reasoning into a reasoning item, each tool call into a
        function_call item."""
        yield self._event("response.created", response=self.response())
        yield self._event("response.in_progress", response=self.response())
        message = reasoning_item = None
        async with aclosing(run_choices(self.streams, [self.choice], {"completion_tokens": self.completion})) as evs:
            async for ev in evs:
                if ev.error:
                    self.status = "failed"
                    yield self._event("error", code="engine_error", message=ev.error, param=None)
                    break
                if ev.reasoning:
                    if reasoning_item is None:
                        reasoning_item = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                          "content": [{"type": "reasoning_text", "text": ""}]}
                        self.output.append(reasoning_item)
                        yield self._event("response.output_item.added", output_index=len(self.output) - 1,
                                          item=reasoning_item)
                    reasoning_item["content"][0]["text"] += ev.reasoning
                    yield self._event("response.reasoning_text.delta", item_id=reasoning_item["id"],
                                      output_index=self.output.index(reasoning_item), content_index=0,
                                      delta=ev.reasoning)
                if ev.content:
                    if message is None:
                        message = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                                   "role": "assistant", "content": []}
                        self.output.append(message)
                        idx = len(self.output) - 1
                        yield self._event("response.output_item.added", output_index=idx, item=message)
                        part = {"type": "output_text", "text": "", "annotations": []}
                        message["content"].append(part)
                        yield self._event("response.content_part.added", item_id=message["id"], output_index=idx,
                                          content_index=0, part={**part})
                    message["content"][0]["text"] += ev.content
                    yield self._event("response.output_text.delta", item_id=message["id"],
                                      output_index=self.output.index(message), content_index=0, delta=ev.content)
                for _, call_id, name, args in ev.tool_calls:
                    item = {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
                            "arguments": "", "status": "in_progress"}
                    self.output.append(item)
                    idx = len(self.output) - 1
                    yield self._event("response.output_item.added", output_index=idx, item={**item})
                    yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=idx, delta=args)
                    item.update(arguments=args, status="completed")
                    yield self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=idx, arguments=args)
                    yield self._event("response.output_item.done", output_index=idx, item=item)
                if ev.finish:
                    self._finish(ev.finish)
        for item in (reasoning_item, message):
            if item is None:
                continue
            idx = self.output.index(item)
            if item is message:
                text = message["content"][0]["text"]
                message["status"] = "completed"
                yield self._event("response.output_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=text)
                yield self._event("response.content_part.done", item_id=item["id"], output_index=idx,
                                  content_index=0, part=message["content"][0])
            yield self._event("response.output_item.done", output_index=idx, item=item)
        if self.status == "failed":
            yield self._event("response.failed", response=self.response())
        else:
            yield self._event("response.completed" if self.status == "completed" else "response.incomplete",
                              response=self.response())

    async def whole(self) -> dict:
        async for _ in self.sse():
            pass
        if self.status == "failed":
            raise APIError(500, "The engine failed while generating the response.", code="engine_error")
        return self.response()
