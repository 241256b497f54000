"""Conversations to and from files (Qt-free): Markdown to read or share, JSON to import again (title, system prompt,
the conversation's settings, the MCP servers chosen under Tools (by name: one not configured where it is imported
stays chosen and shows as unavailable), and every message with its numbers and the model that wrote it; tool calls and MCP
tool results included; a user message's images by content, base64, checked again on import as when attached)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.chat.images import MAX_IMAGES, ChatImage, ImageRefused, image_from_part
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
        out += [f"*[image: {im.name}, {im.width} x {im.height}]*" for im in m.images] + ([""] if m.images else [])
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
                      "stats": m.stats, **({"model": m.model} if m.model else {}),
                      **({"images": [im.to_dict() for im in m.images]} if m.images else {})} for m in messages]},
        indent=2, ensure_ascii=False) + "\n"


class ConversationFileError(ValueError):
    """The file is not a conversation this app can read; the message says why and what to do."""


@dataclass
class ImportedConversation:
    title: str
    system_prompt: str
    options: dict[str, Any]
    messages: list[Message]
    tools: list[str] = field(default_factory=list)  # the MCP servers chosen under Tools, by name


def from_json(text: str) -> tuple[str, str, dict[str, Any], list[Message]]:
    """(title, system prompt, options, messages) of ``read_json``."""
    got = read_json(text)
    return got.title, got.system_prompt, got.options, got.messages


def read_json(text: str) -> ImportedConversation:
    """A conversation from a file written by to_json, or an OpenAI-style ``{"messages": [...]}`` / bare message
    list."""
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
        images = _images(m, i)
        if not isinstance(content, str):  # OpenAI content parts: the text ones (images: _images)
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if m["role"] == "system" and not system:
            system = content
            continue
        stats = dict(m.get("stats") or {})
        if m["role"] == "tool" and m.get("tool_call_id"):  # OpenAI-style: the call it answers
            stats.setdefault("tool_call_id", str(m["tool_call_id"]))
        messages.append(Message(m["role"], content, str(m.get("reasoning") or ""), list(m.get("tool_calls") or []),
                                stats, model=str(m.get("model") or ""), images=images))
    title = str(data.get("title") or next((m.content.splitlines()[0][:48] for m in messages
                                           if m.role == "user" and m.content.strip()), "Imported chat"))
    options = data.get("options") if isinstance(data.get("options"), dict) else {}
    return ImportedConversation(title, system, options, messages, _tools(data))


def _tools(data: dict) -> list[str]:
    tools = data.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, str) and t.strip() for t in tools):
        raise ConversationFileError(f'"tools" must be a list of server names (the MCP servers chosen under Tools), '
                                    f"not {json.dumps(tools)[:80]}. Fix it in the file, or export the conversation "
                                    "again.")
    return list(dict.fromkeys(tools))


def _images(m: dict, i: int) -> list[ChatImage]:
    """Message ``i``'s images: this app's ``images`` list, or OpenAI ``image_url`` parts with data: URIs."""
    parts = m.get("content") if isinstance(m.get("content"), list) else []
    try:
        if isinstance(m.get("images"), list):
            images = [ChatImage.from_dict(d) for d in m["images"] if isinstance(d, dict)]
        else:
            found = [p for p in parts if isinstance(p, dict) and p.get("type") == "image_url"]
            images = [image_from_part(p, k) for k, p in enumerate(found)]
    except ImageRefused as e:
        raise ConversationFileError(f"Message {i + 1}: {e}") from None
    if len(images) > MAX_IMAGES:
        raise ConversationFileError(f"Message {i + 1} has {len(images)} images; a message holds at most "
                                    f"{MAX_IMAGES}. Split it, or remove some from the file.")
    return images
