"""Conversations on disk (Qt-free): SQLite under the user's data dir.

A conversation has a title, a system prompt, its own sampling options (temperature, top-p, top-k, max tokens; unset
ones follow the server's mode) and ordered messages; a message keeps its role, content, reasoning, tool
calls, the numbers measured while it streamed (tokens, TTFT, tok/s) and, for an answer, the id of the model that
wrote it ("" in a database from before models were recorded). A ``tool`` message is an MCP tool's result; its stats
name the call it answers (``tool_call_id``), the tool and whether it failed. A user message keeps its images by
content (base64 JSON, app/chat/images.py). A conversation also keeps which MCP
servers' tools it offers the model. Writes commit at once, so a crash loses at most the
message being streamed.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app import paths
from app.chat import images as chat_images
from app.chat.images import ChatImage

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    tool_calls TEXT NOT NULL DEFAULT '[]',
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    model TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, position);
"""


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # tokens, ttft, tok_s, finish, error
    id: int | None = None
    model: str = ""  # an answer: the id of the model that wrote it ("" when not recorded)
    images: list[ChatImage] = field(default_factory=list)  # a user message's, in the order attached

    def api_dict(self) -> dict[str, Any]:
        """As an OpenAI chat message (reasoning is not sent back; images as content parts before the text)."""
        d: dict[str, Any] = {"role": self.role, "content": chat_images.content(self.content, self.images)}
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        if self.role == "tool":  # an MCP tool's result (app/chat/tools.py): which call it answers
            d["tool_call_id"] = self.stats.get("tool_call_id", "")
        return d


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str = ""
    created: float = 0.0
    updated: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, max_tokens
    tools: list[str] = field(default_factory=list)  # the MCP servers whose tools the model is offered


class ConversationStore:
    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path else paths.conversations_db()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path))
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(SCHEMA)
        self._add_column("conversations", "options", "TEXT NOT NULL DEFAULT '{}'")  # databases from earlier versions
        self._add_column("messages", "model", "TEXT NOT NULL DEFAULT ''")
        self._add_column("conversations", "tools", "TEXT NOT NULL DEFAULT '[]'")
        self._add_column("messages", "images", "TEXT NOT NULL DEFAULT '[]'")
        self.db.commit()

    def _add_column(self, table: str, column: str, kind: str) -> None:
        if column not in {r["name"] for r in self.db.execute(f"PRAGMA table_info({table})")}:
            self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self.db.close()

    # ---- conversations ---------------------------------------------------------------------------------------
    def create(self, title: str = "New chat", system_prompt: str = "") -> Conversation:
        now = time.time()
        cur = self.db.execute("INSERT INTO conversations(title, system_prompt, created, updated) VALUES (?,?,?,?)",
                              (title, system_prompt, now, now))
        self.db.commit()
        return Conversation(cur.lastrowid, title, system_prompt, now, now)

    def _conv(self, row) -> Conversation:
        try:
            options = json.loads(row["options"] or "{}")
        except ValueError:
            options = {}
        try:
            tools = json.loads(row["tools"] or "[]")
        except ValueError:
            tools = []
        return Conversation(row["id"], row["title"], row["system_prompt"], row["created"], row["updated"],
                            options if isinstance(options, dict) else {},
                            [t for t in tools if isinstance(t, str)] if isinstance(tools, list) else [])

    def get(self, conversation_id: int) -> Conversation | None:
        row = self.db.execute("SELECT * FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        return self._conv(row) if row else None

    def list(self, search: str = "") -> list[Conversation]:
        """Newest first; ``search`` matches titles and message text (case-insensitive)."""
        if search.strip():
            like = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self.db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m "
                "WHERE m.conversation_id=c.id AND m.content LIKE ? ESCAPE '\\') ORDER BY updated DESC, id DESC",
                (like, like)).fetchall()
        else:
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC").fetchall()
        return [self._conv(r) for r in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title=?, updated=? WHERE id=?",
                        (title.strip() or "Untitled", time.time(), conversation_id))
        self.db.commit()

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self.db.execute("UPDATE conversations SET system_prompt=? WHERE id=?", (text, conversation_id))
        self.db.commit()

    def set_options(self, conversation_id: int, options: dict[str, Any]) -> None:
        self.db.execute("UPDATE conversations SET options=? WHERE id=?",
                        (json.dumps({k: v for k, v in options.items() if v is not None}), conversation_id))
        self.db.commit()

    def set_tools(self, conversation_id: int, servers: list[str]) -> None:
        self.db.execute("UPDATE conversations SET tools=? WHERE id=?", (json.dumps(list(servers)), conversation_id))
        self.db.commit()

    def delete(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))
        self.db.commit()

    # ---- messages ----------------------------------------------------------------------------------------------
    def messages(self, conversation_id: int) -> list[Message]:
        rows = self.db.execute("SELECT * FROM messages WHERE conversation_id=? ORDER BY position",
                               (conversation_id,)).fetchall()
        return [Message(r["role"], r["content"], r["reasoning"], json.loads(r["tool_calls"]), json.loads(r["stats"]),
                        r["id"], r["model"], [ChatImage.from_dict(d, check=False) for d in json.loads(r["images"])])
                for r in rows]

    def append(self, conversation_id: int, message: Message) -> Message:
        (position,) = self.db.execute("SELECT COALESCE(MAX(position), -1) + 1 FROM messages WHERE conversation_id=?",
                                      (conversation_id,)).fetchone()
        self._insert(conversation_id, position, message)
        self.db.commit()
        return message

    def _insert(self, conversation_id: int, position: int, message: Message) -> None:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages(conversation_id, position, role, content, reasoning, tool_calls, stats, created, "
            "model, images) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (conversation_id, position, message.role, message.content, message.reasoning,
             json.dumps(message.tool_calls), json.dumps(message.stats), now, message.model,
             json.dumps([im.to_dict() for im in message.images])))
        self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conversation_id))
        message.id = cur.lastrowid

    def replace(self, conversation_id: int, start: int, end: int, messages: list[Message]) -> list[Message]:
        """Messages ``start`` to ``end - 1`` give way to ``messages`` (a turn's answer switched to another
        version); the messages after them follow, in their order."""
        ids = [r[0] for r in self.db.execute("SELECT id FROM messages WHERE conversation_id=? ORDER BY position",
                                             (conversation_id,)).fetchall()]
        self.db.executemany("DELETE FROM messages WHERE id=?", [(i,) for i in ids[start:end]])
        later = ids[end:]
        self.db.executemany("UPDATE messages SET position=? WHERE id=?",
                            [(start + len(messages) + n, i) for n, i in enumerate(later)])
        for n, m in enumerate(messages):
            self._insert(conversation_id, start + n, m)
        self.db.commit()
        return messages

    def update(self, message: Message) -> None:
        if message.id is None:
            raise ValueError("the message was never stored")
        self.db.execute("UPDATE messages SET content=?, reasoning=?, tool_calls=?, stats=?, model=? WHERE id=?",
                        (message.content, message.reasoning, json.dumps(message.tool_calls),
                         json.dumps(message.stats), message.model, message.id))
        self.db.commit()

    def truncate(self, conversation_id: int, keep: int) -> None:
        """Keeps the first ``keep`` messages (for regenerate and edit-and-resend)."""
        ids = [r[0] for r in self.db.execute("SELECT id FROM messages WHERE conversation_id=? ORDER BY position",
                                             (conversation_id,)).fetchall()][max(keep, 0):]
        self.db.executemany("DELETE FROM messages WHERE id=?", [(i,) for i in ids])
        self.db.commit()
