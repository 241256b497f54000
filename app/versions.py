"""Regenerated answers kept as versions to flip through (Qt-free).

An answer's ``stats["versions"]`` lists every answer given at that point (content, reasoning, tool calls, numbers),
and ``stats["version"]`` which one is shown; the message's own fields are the shown one's, so what is sent back to
the model is always the version on screen.
"""
from __future__ import annotations

from typing import Any

from app.store import Message

KEYS = ("versions", "version")


def snapshot(m: Message) -> dict[str, Any]:
    return {"content": m.content, "reasoning": m.reasoning, "tool_calls": list(m.tool_calls),
            "stats": {k: v for k, v in m.stats.items() if k not in KEYS}}


def earlier(m: Message | None) -> list[dict[str, Any]]:
    """The versions an answer about to be regenerated leaves (itself included, when it has anything to keep)."""
    if m is None or m.role != "assistant":
        return []
    versions = [dict(v) for v in m.stats.get("versions") or []]
    if not versions and (m.content or m.tool_calls):
        versions = [snapshot(m)]
    return versions


def finish(m: Message, before: list[dict[str, Any]]) -> None:
    """The new answer ``m`` is complete: it becomes the last version, shown."""
    if before:
        m.stats["versions"] = before + [snapshot(m)]
        m.stats["version"] = len(before)


def count(m: Message) -> int:
    return len(m.stats.get("versions") or [])


def show(m: Message, k: int) -> bool:
    """Shows version ``k`` of ``m``; False when there is no such version."""
    versions = m.stats.get("versions") or []
    if not 0 <= k < len(versions):
        return False
    v = versions[k]
    m.content, m.reasoning, m.tool_calls = v["content"], v["reasoning"], list(v["tool_calls"])
    m.stats = {**v["stats"], "versions": versions, "version": k}
    return True
