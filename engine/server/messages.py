"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API (what Claude Code and the
`anthropic` SDK send), mapped onto the chat pipeline: the request becomes chat messages, tools and sampling values,
the model's output comes back as content blocks (engine.server.messages_reply).

Claude Code puts a per-request attribution block first in `system` (its text starts with
`x-anthropic-billing-header`); it changes with every request and would defeat prefix reuse, so it is dropped.
"""
from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from engine.server.chat import SSE_HEADERS, output_constraint, parallel_calls, render
from engine.server.errors import APIError, shown
from engine.server.generation import Choice, sampling_params, submit, unless_disconnected
from engine.server.images import MEDIA_TYPES, image_part
from engine.server.messages_reply import MessageReply
from engine.server.omitted import hosted_tool_name, omitted_header
from engine.server.parsers import offered_tools
from engine.server.schemacheck import schema_problems
from engine.server.schemas import (INT32_MAX, MAX_MESSAGES, MAX_STOP, MAX_TOOLS, Bool, ChatCompletionRequest, Float,
                                   Int, TokenCount, _Open)
from engine.server.state import ServerState
from engine.server.thinking import thinking_constraint

BILLING_HEADER = "x-anthropic-billing-header"
_THINKING_EFFORT = {"enabled": "high", "disabled": "none", "adaptive": None}


class MessagesRequest(_Open):
    """Anthropic's request body; fields this server has no use for (metadata, context_management, output_config,
    service_tier, container, ...) are accepted and ignored; mcp_servers run the servers of --mcp-config
    (engine.server.mcp_messages)."""
    model: str
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    system: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    max_tokens: TokenCount | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=0, le=INT32_MAX)
    stream: Bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def uses_mcp(req: MessagesRequest) -> bool:
    """Does the request ask for MCP servers (Anthropic's MCP connector: mcp_servers, mcp_toolset tools)?"""
    return bool((req.model_extra or {}).get("mcp_servers")) or \
        any(isinstance(t, dict) and t.get("type") == "mcp_toolset" for t in req.tools or [])


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _string(block: dict, key: str, where: str) -> str:
    """A block's text field: a string (absent: empty), never a number or object turned into text."""
    value = block.get(key, "")
    if not isinstance(value, str):
        raise _bad(f"{where}.{key} must be a string, not {type(value).__name__}.", f"{where}.{key}")
    return value


def _text_blocks(content: Any, where: str) -> str:
    """The text of a string or a list of text blocks (system); anything else is a 400."""
    content = _content_blocks(content, where, images=False)
    return content if isinstance(content, str) else ""


def _content_blocks(content: Any, where: str, images: bool = True) -> str | list[dict]:
    """A string or a list of text (and, where `images`, image) blocks: the text, or chat content parts when it
    holds an image."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content blocks.", where)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", f"{where}[{j}]")})
        elif kind == "image" and images:
            parts.append(_image_block(block, f"{where}[{j}]"))
        elif kind in ("image", "document"):
            raise _bad(f"{where}[{j}] is an {kind} block, which is not accepted here; send text.", f"{where}[{j}]")
        else:
            allowed = "text and image blocks are" if images else "only text blocks are"
            raise _bad(f"{where}[{j}] has type {shown(kind)}; {allowed} allowed here.", f"{where}[{j}]")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_block(block: dict, where: str) -> dict:
    """An image block's source (base64 or url) as the chat part engine.server.images reads."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise _bad(f"{where}.source needs media_type (image/png, image/jpeg, image/gif or image/webp) and data "
                       f"(the base64 of the file), both strings.", f"{where}.source")
        if media.strip().lower() not in MEDIA_TYPES.values():
            raise _bad(f"{where}.source.media_type {shown(media)} is not accepted; use one of "
                       f"{', '.join(MEDIA_TYPES.values())}.", f"{where}.source.media_type")
        return image_part(f"data:{media.strip()};base64,{data}", where, media_type=media)
    if kind == "url":
        return image_part(source.get("url"), where)
    if kind == "file":
        raise _bad(f"{where}.source is a file (Files API), which this server does not store; send the image as a "
                   f"base64 source.", f"{where}.source")
    raise _bad(f"{where}.source.type must be base64 or url, not {shown(kind)}.", f"{where}.source")


def system_prompt(system: str | list[dict] | None) -> str:
    """The system text: a string, or text blocks joined by blank lines (cache_control ignored), without Claude
    Code's per-request billing block."""
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for j, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"system[{j}] has type {shown(kind)}; system blocks must be text blocks.", f"system[{j}]")
        text = _string(block, "text", f"system[{j}]")
        if not text.lstrip().startswith(BILLING_HEADER):
            parts.append(text)
    return "\n\n".join(p for p in parts if p)


def _user_blocks(content: Any, i: int, out: list[dict]) -> None:
    """A user turn: text and image blocks become user messages, tool_result blocks tool messages, in their order."""
    if isinstance(content, str):
        _add_user(out, content)
        return
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content must be a string or a list of content blocks.", f"messages[{i}].content")
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            _add_user(out, _string(block, "text", where))
        elif kind == "image":
            _add_user(out, _image_block(block, where))
        elif kind == "tool_result":
            result = _content_blocks(block.get("content"), where + ".content")
            if block.get("is_error"):
                result = _error_result(result)
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result})
        elif kind == "document":
            raise _bad(f"{where} is a document block, which this server does not read. Send the document's text "
                       f"as a text block.", where)
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _bad(f"{where} has type {shown(kind)}; a user turn may hold text, image and tool_result blocks.",
                       where)


def _error_result(result: str | list[dict]) -> str | list[dict]:
    if isinstance(result, str):
        return f"Error: {result}" if result else "Error"
    return [{"type": "text", "text": "Error:"}, *result]


def _add_user(out: list[dict], item: str | dict) -> None:
    """Appends user text (or an image part), merged into a user message just before it (templates want turns to
    alternate): text blocks joined by blank lines; with an image, the message holds a list of parts, each image
    where it stood between the texts (as a chat request's parts)."""
    last = out[-1] if out else None
    if last is None or last["role"] != "user":
        out.append({"role": "user", "content": item if isinstance(item, str) else [item]})
        return
    if isinstance(last["content"], str):
        if isinstance(item, str):
            last["content"] = f"{last['content']}\n\n{item}" if last["content"] else item
            return
        last["content"] = [{"type": "text", "text": last["content"]}] if last["content"] else []
    parts = last["content"]
    if isinstance(item, str) and parts and parts[-1]["type"] == "text":
        parts[-1] = {"type": "text", "text": f"{parts[-1]['text']}\n\n{item}" if parts[-1]["text"] else item}
    else:
        parts.append({"type": "text", "text": item} if isinstance(item, str) else item)


def _assistant_blocks(content: Any, i: int, out: list[dict]) -> None:
    if isinstance(content, str):
        out.append({"role": "assistant", "content": content})
        return
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content must be a string or a list of content blocks.", f"messages[{i}].content")
    texts, thinking, calls = [], [], []
    for j, block in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", where))
        elif kind == "redacted_thinking":
            continue  # encrypted by another provider: nothing this model can read
        elif kind == "tool_use":
            args = block.get("input")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": json.dumps(args if isinstance(args, dict) else {})}})
        else:
            raise _bad(f"{where} has type {shown(kind)}; an assistant turn may hold text, thinking, redacted_thinking "
                       f"and tool_use blocks.", where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)  # kept or dropped by the template
    if calls:
        message["tool_calls"] = calls
    out.append(message)


def to_chat_messages(req: MessagesRequest) -> list[dict]:
    """Anthropic system + messages -> chat messages. `system`-role entries before the conversation join the system
    prompt; later ones are passed as user text (most templates accept a system message only first)."""
    system = [system_prompt(req.system)] if req.system else []
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with a role and content.", f"messages[{i}]")
        role, content = m.get("role"), m.get("content")
        if role == "system":
            text = _text_blocks(content, f"messages[{i}].content")
            if out:
                _add_user(out, text)
            else:
                system.append(text)
        elif role == "user":
            _user_blocks(content, i, out)
        elif role == "assistant":
            _assistant_blocks(content, i, out)
        else:
            raise _bad(f"messages[{i}].role must be user or assistant (or system), not {shown(role)}.",
                       f"messages[{i}].role")
    system_text = "\n\n".join(s for s in system if s)
    return ([{"role": "system", "content": system_text}] if system_text else []) + out


def to_chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[str]]:
    """Custom tools as function tools; Anthropic's own tool types (web search, code execution, bash, ...) cannot
    run here: they are left out and named in the second list."""
    out, omitted = [], []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}] must be an object.", f"tools[{i}]")
        kind = t.get("type")
        if kind not in (None, "custom"):
            omitted.append(hosted_tool_name(t.get("name") or kind, f"tools[{i}].name"))
            continue
        fn = {"name": t.get("name"), "parameters": t.get("input_schema") or {"type": "object"}}
        problems = schema_problems(fn["parameters"], f"tools[{i}].input_schema")
        if problems:
            raise _bad("Invalid tools: " + "; ".join(problems) + ".", "tools")
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None, omitted


def to_chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice -> (chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
               "{\"type\": \"tool\", \"name\": ...}.", "tool_choice")


def thinking_effort(thinking: dict | None) -> str | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if not isinstance(kind, str) or kind not in _THINKING_EFFORT:
        raise _bad(f"thinking.type must be enabled, adaptive or disabled, not {shown(kind)}.", "thinking.type")
    return _THINKING_EFFORT[kind]


def thinking_budget(thinking: dict | None) -> int | None:
    """thinking.budget_tokens of an `enabled` thinking: the most reasoning tokens before the answer must start."""
    if thinking is None or thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
        return None
    budget = thinking["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= INT32_MAX:
        raise _bad(f"thinking.budget_tokens must be a whole number from 1 to {INT32_MAX}: the most tokens the "
                   f"model may think before it answers.", "thinking.budget_tokens")
    return budget


def to_chat_request(req: MessagesRequest, served: str) -> tuple[ChatCompletionRequest, list[str]]:
    tools, omitted = to_chat_tools(req.tools)
    tool_choice, parallel = to_chat_tool_choice(req.tool_choice)
    if tools is None and tool_choice not in (None, "auto", "none"):
        raise _bad("tool_choice asks for a tool call, but no tools were sent.", "tool_choice")
    try:
        chat = ChatCompletionRequest(
            model=served, messages=to_chat_messages(req) or [{"role": "user", "content": ""}], tools=tools,
            tool_choice=tool_choice, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, stop=req.stop_sequences, reasoning_effort=thinking_effort(req.thinking),
            parallel_tool_calls=parallel)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = {"stop": "stop_sequences"}.get(str(first["loc"][0]), "messages") if first["loc"] else "messages"
        raise _bad(f"The request cannot be read: {where}: {first['msg']}.", param) from None
    return chat, omitted


def prepare(state: ServerState, req: MessagesRequest, served: str):
    """(chat request, omitted tools, prompt token ids, whether the answer starts in reasoning, the images).
    CPU-bound (a long conversation takes seconds to convert and encode): call it in a worker thread."""
    chat, omitted = to_chat_request(req, served)
    prompt, in_reasoning, images = render(state, chat)
    return chat, omitted, prompt, in_reasoning, images


async def start_reply(req: MessagesRequest, state: ServerState) -> tuple[MessageReply, list[str]]:
    """The request read, rendered and submitted: (its reply, to stream or to collect; the tools left out)."""
    served = state.check_model(req.model)
    loaded = state.ready()
    if req.max_tokens is None:
        raise _bad("max_tokens is required: the most tokens the answer may have (it is capped to the room left "
                   "in the context).", "max_tokens")
    budget = thinking_budget(req.thinking)
    chat, omitted, prompt, in_reasoning, images = await asyncio.to_thread(prepare, state, req, served)
    params = sampling_params(chat, state, len(prompt), loaded.context_window)
    params.constraint = await asyncio.to_thread(output_constraint, loaded.tokenizer, chat, in_reasoning)
    params.constraint = thinking_constraint(state, loaded.tokenizer, chat.reasoning_effort, params.max_tokens,
                                            in_reasoning, params.constraint, explicit=budget)
    reasoning = "<think>" in (loaded.tokenizer.chat_template or "")
    streams = submit(state, prompt, params, 1, images=images)
    choice = Choice(0, loaded.tokenizer, chat.stop_list(), reasoning=reasoning, starts_in_reasoning=in_reasoning,
                    tool_names=offered_tools(chat.tools, chat.tool_choice),
                    parallel_calls=parallel_calls(chat))
    hide = (req.thinking or {}).get("display") == "omitted"
    return MessageReply(req.model, streams, choice, len(prompt), hide_thinking=hide), omitted


async def messages(req: MessagesRequest, state: ServerState, request=None):
    reply, omitted = await start_reply(req, state)
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **omitted_header(omitted)})
    return JSONResponse(await unless_disconnected(request, reply.whole()), headers=omitted_header(omitted))


async def count_tokens(req: MessagesRequest, state: ServerState) -> dict:
    """The prompt tokens the engine would see for this request (the same rendering as /v1/messages)."""
    served = state.check_model(req.model)
    state.ready()
    _, _, prompt, _, _ = await asyncio.to_thread(prepare, state, req, served)
    return {"input_tokens": len(prompt)}
