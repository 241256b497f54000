"""Regenerated answers kept as versions to flip through (Qt-free).

A version is a whole turn's answer: every message after the user's (with tools, the answer that made the calls,
their results and the answers that followed). The turn's first answer keeps them all: ``stats["versions"]`` lists
every answer given at that point (its own content, reasoning, tool calls, numbers and model, plus ``more``: the
turn's later messages), ``stats["version"]`` which one is shown. The messages on screen are the shown version's, so
what is sent back to the model is always the version on screen; its entry in the list is brought up to date when
another one is shown or the turn is regenerated. (Versions kept before turns had tools have no ``more``.)
"""
from __future__ import annotations

from typing import Any

from app.chat.images import ChatImage
from app.chat.store import Message

KEYS = ("versions", "version")


def snapshot(m: Message) -> dict[str, Any]:
    return {"content": m.content, "reasoning": m.reasoning, "tool_calls": list(m.tool_calls),
            "stats": {k: v for k, v in m.stats.items() if k not in KEYS}, "model": m.model}


def turn_snapshot(turn: list[Message]) -> dict[str, Any]:
    return {**snapshot(turn[0]), "more": [_message_dict(m) for m in turn[1:]]}


def turn_end(messages: list[Message], start: int) -> int:
    """Where the turn whose answer begins at ``start`` ends: the next user message, or the end."""
    return next((i for i in range(start + 1, len(messages)) if messages[i].role == "user"), len(messages))


def _kept(turn: list[Message]) -> list[dict[str, Any]]:
    """The versions of ``turn``, the shown one's entry made what is on screen now."""
    first = turn[0]
    kept = [dict(v) for v in first.stats.get("versions") or []]
    current = first.stats.get("version", len(kept) - 1)
    if isinstance(current, int) and 0 <= current < len(kept):
        kept[current] = turn_snapshot(turn)
    return kept


def earlier(turn: list[Message]) -> list[dict[str, Any]]:
    """The versions a turn about to be regenerated leaves (itself included, when it has anything to keep)."""
    if not turn or turn[0].role != "assistant":
        return []
    if turn[0].stats.get("versions"):
        return _kept(turn)
    return [turn_snapshot(turn)] if any(m.content or m.tool_calls for m in turn) else []


def finish(m: Message, before: list[dict[str, Any]]) -> None:
    """The new answer ``m`` (a turn's first) is complete: it becomes the last version, shown."""
    if before:
        m.stats["versions"] = before + [snapshot(m)]
        m.stats["version"] = len(before)


def count(m: Message) -> int:
    return len(m.stats.get("versions") or [])


def show(turn: list[Message], k: int) -> list[Message] | None:
    """The messages of version ``k`` in place of ``turn`` (the shown version's messages, its first answer first);
    None when there is no such version or it is the one shown."""
    if not turn or not 0 <= k < count(turn[0]) or k == turn[0].stats.get("version"):
        return None
    kept = _kept(turn)
    v = kept[k]
    first = Message("assistant", v["content"], v["reasoning"], list(v["tool_calls"]),
                    {**v["stats"], "versions": kept, "version": k},
                    model=v.get("model", turn[0].model))  # (versions kept before models were recorded have none)
    return [first] + [_message(d) for d in v.get("more") or []]


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
    messages = [_message(d) for d in chosen]
    messages[0].stats["branches"] = every
    messages[0].stats["branch"] = k
    return messages


def _message(d: dict[str, Any]) -> Message:
    images = [ChatImage.from_dict(i, check=False) for i in d.get("images") or []]
    return Message(d["role"], d["content"], d["reasoning"], list(d["tool_calls"]), dict(d["stats"]),
                   model=d.get("model", ""), images=images)
