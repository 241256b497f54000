"""The chat's tool widgets: the Tools bar (which MCP servers' tools this conversation offers the model, and the way
to MCP servers…) and the approval bar a tool call waits at (Approve once / Always for this tool / Deny)."""
from __future__ import annotations

import asyncio
import html
import json

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.mcp.approvals import ALWAYS, APPROVE, DENY
from engine.mcp.names import ToolInfo

from app.chat.flow_layout import FlowLayout

ARGS_SHOWN = 300  # characters of a call's arguments shown in the approval bar


class ToolsBar(QWidget):
    """One checkbox per server of mcp.json, in rows that wrap to the chat's width; ``changed`` when the user picks
    or drops one. A server the conversation chose that this machine's mcp.json lacks (an imported chat) or has
    disabled keeps its checkbox, marked unavailable, so its name is never lost; unticking it drops it."""

    changed = Signal()
    edit_requested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 4)
        self.row = FlowLayout()
        title = QLabel("Tools for this chat:")
        title.setObjectName("Muted")
        self.row.addWidget(title)
        self.require = QCheckBox("Call a tool first")
        self.require.setToolTip("The first answer of each turn must be a tool call (tool_choice \"required\"): "
                                "for a small model that would not call one by itself")
        self.require.toggled.connect(self.changed)
        self.row.addWidget(self.require)
        self.edit_button = QPushButton("MCP servers…")
        self.edit_button.setToolTip("Add, edit and test the MCP servers of mcp.json; the limits on tool calls")
        self.edit_button.clicked.connect(self.edit_requested)
        self.row.addWidget(self.edit_button)
        layout.addLayout(self.row)
        self.note = QLabel()
        self.note.setObjectName("Muted")
        self.note.setWordWrap(True)
        layout.addWidget(self.note)
        self.boxes: dict[str, QCheckBox] = {}
        self.order: list[str] = []  # the conversation's servers in its order (the ones ticked later follow)
        self.unavailable: list[str] = []  # chosen, but not a usable server of mcp.json here

    def set_servers(self, servers: dict, chosen: list[str], error: str | None = None, require: bool = False) -> None:
        """``servers``: name -> ServerConfig (mcp.json); ``chosen``: the conversation's; ``error``: why mcp.json
        cannot be used; ``require``: Call a tool first."""
        self.require.blockSignals(True)
        self.require.setChecked(require)
        self.require.blockSignals(False)
        for box in self.boxes.values():
            self.row.removeWidget(box)
            box.deleteLater()
        self.boxes = {}
        usable = {name: server for name, server in servers.items() if not server.disabled}
        self.order = list(dict.fromkeys(chosen))
        self.unavailable = [name for name in self.order if name not in usable]
        for name, server in usable.items():
            self._add_box(name, f"Offer the tools of {name} ({server.describe()}) to the model in this chat. "
                                "Each call waits for your approval.", name in chosen)
        for name in self.unavailable:
            self._add_box(name, f"{name} is not a server of mcp.json here (or is disabled): its tools are off. "
                                "Untick it to drop it from this chat.", True,
                          f"{name} (not configured)" if name not in servers else f"{name} (disabled)")
        self.note.setText(self._note(error, servers))

    def _add_box(self, name: str, tip: str, checked: bool, text: str | None = None) -> None:
        box = QCheckBox(text or name)
        box.setToolTip(tip)
        box.setChecked(checked)
        box.toggled.connect(self.changed)
        self.row.insertWidget(1 + len(self.boxes), box)
        self.boxes[name] = box

    def _note(self, error: str | None, servers: dict) -> str:
        said = [error] if error else []
        for name in self.unavailable:
            where = "disabled in mcp.json" if name in servers else "not configured on this machine"
            said.append(f'This chat had the MCP server "{name}" on, but it is {where}: its tools are off. Add it '
                        "under MCP servers… to use them (untick it to drop it).")
        if said:
            return " ".join(said)
        if not self.boxes:
            return ("No MCP servers yet: add one with MCP servers… (or put an mcp.json in the app's config "
                    "folder).")
        return "While tools are on, answers use Agent mode's sampling (this chat's own values win)."

    def chosen(self) -> list[str]:
        """The servers the conversation keeps (unavailable ones included)."""
        on = [name for name, box in self.boxes.items() if box.isChecked()]
        return [n for n in self.order if n in on] + [n for n in on if n not in self.order]

    def usable(self) -> list[str]:
        """The chosen servers this machine's mcp.json has: those whose tools a turn may offer."""
        return [name for name in self.chosen() if name not in self.unavailable]


class ApprovalBar(QWidget):
    """Above the message box while a tool call waits: what would run, and the three answers."""

    def __init__(self, parent=None):
        super().__init__(parent)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.label = QLabel()
        self.label.setWordWrap(True)
        layout.addWidget(self.label, 1)
        self.approve_button = QPushButton("Approve once")
        self.approve_button.setObjectName("Primary")
        self.always_button = QPushButton("Always for this tool")
        self.deny_button = QPushButton("Deny")
        for button, decision in ((self.approve_button, APPROVE), (self.always_button, ALWAYS),
                                 (self.deny_button, DENY)):
            button.clicked.connect(lambda _=False, d=decision: self.answer(d))
            layout.addWidget(button)
        self._future: asyncio.Future | None = None
        self.setVisible(False)

    @property
    def waiting(self) -> bool:
        return self._future is not None and not self._future.done()

    async def ask(self, tool: ToolInfo, arguments: dict) -> str:
        """Shows the call and waits for the user's answer: APPROVE, ALWAYS or DENY."""
        shown = json.dumps(arguments, ensure_ascii=False)
        if len(shown) > ARGS_SHOWN:
            shown = shown[:ARGS_SHOWN] + "…"
        self.label.setText(f"Run <b>{_esc(tool.name)}</b> of the MCP server <b>{_esc(tool.server)}</b> with "
                           f"<code>{_esc(shown)}</code>?")
        self.always_button.setToolTip(f"Run {tool.name} of {tool.server} from now on without asking (remembered)")
        self._future = asyncio.get_running_loop().create_future()
        self.setVisible(True)
        self.approve_button.setFocus()
        try:
            return await self._future
        finally:
            self._future = None
            self.setVisible(False)

    def answer(self, decision: str) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(decision)


def _esc(text: str) -> str:
    return html.escape(text, quote=False)
