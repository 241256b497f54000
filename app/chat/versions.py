"""Regenerated answers kept as versions to flip through (Qt-free).

An answer's ``stats["versions"]`` lists every answer given at that point (content, reasoning, tool calls, numbers),
and ``stats["version"]`` which one is shown; the message's own fields are the shown one's, so what is sent back to
the model is always the version on screen.
"""
from __future__ import annotations

from typing import Any

from app.chat.images import ChatImage
from app.chat.store import Message

KEYS = ("versions", "version")


def snapshot(m: Message) -> dict[str, Any]:
    return {"content": m.content, "reasoning": m.reasoning, "tool_calls": list(m.tool_calls),
            "stats": {k: v for k, v in m.stats.items() if k not in KEYS}, "model": m.model}


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
    m.model = v.get("model", m.model)  # (versions kept before models were recorded have none)
    m.stats = {**v["stats"], "versions": versions, "version": k}
    return True


# ---- branches: editing a message keeps what followed it -------------------------------------------------------------
# The edited user message's ``stats["branches"]`` lists the other branches from that point (each a list of message
# snapshots, the user message first), ``stats["branch"]`` where the one shown stands among them all.

BRANCH_KEYS = ("branches", "branch")


def _message_dict(m: Message) -> dict[str, Any]:
    return {"role": m.role, "content": m.content, "reasoning": m.reasoning, "tool_calls": list(m.tool_calls),
            "stats": {k: v for k, v in m.stats.items() if k not in BRANCH_KEYS}, "model": m.model,
            **({"images": [im.to_dict() for im in m.images]} if m.images else {})}


def branch_count(m: Message) -> int:
    return len(m.stats.get("branches") or []) + 1 if m.stats.get("branches") else 1


def edited(tail: list[Message], new_user: Message) -> None:
    """``tail`` (the edited message and what followed) becomes a branch of ``new_user``, which is shown last."""
    head = tail[0]
    others = [list(b) for b in head.stats.get("branches") or []]
    position = head.stats.get("branch", len(others))
    others.insert(position, [_message_dict(m) for m in tail])
    new_user.stats["branches"] = others
    new_user.stats["branch"] = len(others)


def switch(tail: list[Message], k: int) -> list[Message] | None:
    """The messages of branch ``k`` in place of ``tail`` (which becomes one of the others), or None."""
    head = tail[0]
    others = [list(b) for b in head.stats.get("branches") or []]
    current = head.stats.get("branch", len(others))
    every = others[:current] + [[_message_dict(m) for m in tail]] + others[current:]
    if not others or not 0 <= k < len(every) or k == current:
        return None
    chosen = every.pop(k)
    messages = [Message(d["role"], d["content"], d["reasoning"], list(d["tool_calls"]), dict(d["stats"]),
                        model=d.get("model", ""), images=[ChatImage.from_dict(i, check=False)
                                                          for i in d.get("images") or []]) for d in chosen]
    messages[0].stats["branches"] = every
    messages[0].stats["branch"] = k
    return messages
