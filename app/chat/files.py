"""Conversations to and from files (Qt-free): Markdown to read or share, JSON to import again (title, system prompt,
the conversation's settings and every message with its numbers and the model that wrote it; tool calls and MCP
tool results included)."""
from __future__ import annotations

import json
from typing import Any

from app.chat.store import Conversation, Message

FORMAT = "ninfer-conversation"
VERSION = 1


def to_markdown(conv: Conversation, messages: list[Message]) -> str:
    out = [f"# {conv.title}", ""]
    if conv.system_prompt.strip():
        out += ["**System prompt:**", "", conv.system_prompt.strip(), ""]
    for m in messages:
        if m.role == "tool":  # an MCP tool's result
            failed = " (failed)" if m.stats.get("failed") else ""
            out += [f"## Tool result `{m.stats.get('tool') or '?'}`{failed}", "", "```", m.content.rstrip(), "```", ""]
            continue
        who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(m.role, m.role)
        out += [f"## {who}", ""]
        if m.content:
            out += [m.content.rstrip(), ""]
        for call in m.tool_calls:
            fn = call.get("function", {})
            out += [f"Tool call `{fn.get('name', '?')}`:", "", "```json", fn.get("arguments", ""), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def to_json(conv: Conversation, messages: list[Message]) -> str:
    return json.dumps({
        "format": FORMAT, "version": VERSION, "title": conv.title, "system_prompt": conv.system_prompt,
        "options": conv.options, **({"tools": conv.tools} if conv.tools else {}),
        "messages": [{"role": m.role, "content": m.content, "reasoning": m.reasoning, "tool_calls": m.tool_calls,
                      "stats": m.stats, **({"model": m.model} if m.model else {})} for m in messages]},
        indent=2, ensure_ascii=False) + "\n"


class ConversationFileError(ValueError):
    """The file is not a conversation this app can read; the message says why and what to do."""


def from_json(text: str) -> tuple[str, str, dict[str, Any], list[Message]]:
    """(title, system prompt, options, messages) from a file written by to_json, or an OpenAI-style
    ``{"messages": [...]}`` / bare message list."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConversationFileError(f"The file is not JSON ({e}). Pick a conversation exported as JSON.") from None
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ConversationFileError("The file has no list of messages. Pick a conversation exported as JSON "
                           "(or a file with {\"messages\": [...]}).")
    system = str(data.get("system_prompt") or "")
    messages = []
    for i, m in enumerate(data["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ConversationFileError(f"Message {i + 1} has no role of system, user, assistant or tool. "
                               "Fix the file, or export the conversation again.")
        content = m.get("content") or ""
        if not isinstance(content, str):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if m["role"] == "system" and not system:
            system = content
            continue
        stats = dict(m.get("stats") or {})
        if m["role"] == "tool" and m.get("tool_call_id"):  # OpenAI-style: the call it answers
            stats.setdefault("tool_call_id", str(m["tool_call_id"]))
        messages.append(Message(m["role"], content, str(m.get("reasoning") or ""), list(m.get("tool_calls") or []),
                                stats, model=str(m.get("model") or "")))
    title = str(data.get("title") or next((m.content.splitlines()[0][:48] for m in messages
                                           if m.role == "user" and m.content.strip()), "Imported chat"))
    options = data.get("options") if isinstance(data.get("options"), dict) else {}
    return title, system, options, messages
