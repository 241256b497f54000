"""MCP servers…: the servers of mcp.json as a list and a form (a command with its arguments and environment, or a
streamable HTTP URL with its headers), Test connection (starts or reaches the server and lists its tools), the
limits on tool calls (calls per turn, seconds per call) and the "always allowed" tools to forget. Saving writes
mcp.json (every problem named, nothing written while one stands)."""
from __future__ import annotations

import json
import shlex

from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QListWidget, QPlainTextEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from engine.mcp import config as mcp_config
from engine.mcp.client import McpError

from app.asyncutil import spawn

STDIO, HTTP = "Command (stdio)", "URL (streamable HTTP)"


def _pairs(text: str, sep: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.strip() and sep in line:
            key, value = line.split(sep, 1)
            out[key.strip()] = value.strip()
    return out


def entry_text(entry: dict) -> dict[str, str]:
    """A server's JSON entry as the form's texts (whatever its fields hold, so a broken one can be fixed here)."""
    args = entry.get("args")
    env = entry.get("env") if isinstance(entry.get("env"), dict) else {}
    headers = entry.get("headers") if isinstance(entry.get("headers"), dict) else {}
    return {"kind": HTTP if entry.get("url") else STDIO, "command": str(entry.get("command") or ""),
            "args": " ".join(shlex.quote(str(a)) for a in args) if isinstance(args, list) else str(args or ""),
            "env": "\n".join(f"{k}={v}" for k, v in env.items()), "url": str(entry.get("url") or ""),
            "headers": "\n".join(f"{k}: {v}" for k, v in headers.items())}


def raw_entries(path) -> list[list]:
    """The servers of an mcp.json that does not pass the checks, as they stand (none when it is not JSON)."""
    try:
        if path.stat().st_size > mcp_config.MAX_BYTES:
            return []
        data = json.loads(path.read_text(encoding="utf-8"))
        servers = data.get("mcpServers") if isinstance(data, dict) else None
    except (OSError, ValueError):
        return []
    return [[str(n), dict(e)] for n, e in servers.items() if isinstance(e, dict)] if isinstance(servers, dict) else []


class McpServersDialog(QDialog):
    def __init__(self, tools, parent=None):
        super().__init__(parent)
        self.tools = tools
        self.setWindowTitle("MCP servers")
        self.setMinimumWidth(620)
        self.entries: list[list] = []  # [name, JSON entry] in the file's order
        self.current = -1
        self.test_task = None
        self._build()
        self._load()

    # ---- layout --------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QVBoxLayout(self)
        path = QLabel(f"Servers of {self.tools.path} (the mcpServers shape other apps use)")
        path.setObjectName("Muted")
        path.setWordWrap(True)
        layout.addWidget(path)
        top = QHBoxLayout()
        left = QVBoxLayout()
        self.list = QListWidget()
        self.list.currentRowChanged.connect(self._select)
        left.addWidget(self.list, 1)
        row = QHBoxLayout()
        self.add_button, self.remove_button = QPushButton("Add"), QPushButton("Remove")
        self.add_button.clicked.connect(self.add_server)
        self.remove_button.clicked.connect(self.remove_server)
        row.addWidget(self.add_button)
        row.addWidget(self.remove_button)
        left.addLayout(row)
        top.addLayout(left, 1)
        top.addWidget(self._build_form(), 2)
        layout.addLayout(top, 1)
        self._limits(layout)
        self.problem = QLabel()
        self.problem.setObjectName("Error")
        self.problem.setWordWrap(True)
        layout.addWidget(self.problem)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.save)
        buttons.rejected.connect(self.reject)
        self.save_button = buttons.button(QDialogButtonBox.StandardButton.Save)
        layout.addWidget(buttons)

    def _build_form(self) -> QWidget:
        self.form_box = QWidget()
        form = QFormLayout(self.form_box)
        self.name = QLineEdit()
        self.kind = QComboBox()
        self.kind.addItems([STDIO, HTTP])
        self.command, self.args, self.url = QLineEdit(), QLineEdit(), QLineEdit()
        self.command.setPlaceholderText("npx, uvx, python, or a full path")
        self.args.setPlaceholderText("arguments, as in a shell: -y @modelcontextprotocol/server-filesystem /tmp")
        self.url.setPlaceholderText("http://127.0.0.1:8000/mcp")
        self.env, self.headers = QPlainTextEdit(), QPlainTextEdit()
        self.env.setPlaceholderText("NAME=value, one a line")
        self.headers.setPlaceholderText("Authorization: Bearer …, one a line")
        for box in (self.env, self.headers):
            box.setMaximumHeight(60)
        for label, widget in (("Name", self.name), ("Kind", self.kind), ("Command", self.command),
                              ("Arguments", self.args), ("Environment", self.env), ("URL", self.url),
                              ("Headers", self.headers)):
            form.addRow(label, widget)
        self.form = form
        for widget in (self.name, self.command, self.args, self.url):
            widget.textEdited.connect(self._form_changed)
        for widget in (self.env, self.headers):
            widget.textChanged.connect(self._form_changed)
        self.kind.currentTextChanged.connect(self._form_changed)
        self.test_button = QPushButton("Test connection")
        self.test_button.setToolTip("Start (or reach) this server and list its tools")
        self.test_button.clicked.connect(self.test_connection)
        form.addRow("", self.test_button)
        self.test_result = QLabel()
        self.test_result.setWordWrap(True)
        form.addRow("", self.test_result)
        return self.form_box

    def _limits(self, layout) -> None:
        row = QHBoxLayout()
        self.calls = QSpinBox()
        self.calls.setRange(1, 100)
        self.calls.setValue(self.tools.calls_per_turn)
        self.calls.setToolTip("The most tool calls one answer may make before the loop ends")
        self.timeout = QSpinBox()
        self.timeout.setRange(1, 3600)
        self.timeout.setSuffix(" s")
        self.timeout.setValue(int(self.tools.timeout_s))
        self.timeout.setToolTip("How long one tool call may take; a slower one is reported as an error")
        self.forget_button = QPushButton("Ask again for every tool")
        self.forget_button.setToolTip("Forget every \"Always for this tool\"")
        self.forget_button.clicked.connect(self.forget_always)
        self.forget_button.setEnabled(bool(self.tools.approvals.always))
        for widget in (QLabel("Calls per answer"), self.calls, QLabel("Time limit per call"), self.timeout):
            row.addWidget(widget)
        row.addStretch(1)
        layout.addLayout(row)
        forget = QHBoxLayout()
        forget.addWidget(self.forget_button)
        forget.addStretch(1)
        layout.addLayout(forget)

    # ---- the list and the form -----------------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            self.entries = [[name, s.to_json()] for name, s in self.tools.servers().items()]
        except mcp_config.McpConfigError as e:  # the entries as they are, to fix here
            self.entries = raw_entries(self.tools.path)
            self.problem.setText(str(e))
        self.list.clear()
        self.list.addItems([name for name, _ in self.entries])
        self.form_box.setEnabled(bool(self.entries))
        self.remove_button.setEnabled(bool(self.entries))
        if self.entries:
            self.list.setCurrentRow(0)

    def _select(self, row: int) -> None:
        self.current = row
        if not 0 <= row < len(self.entries):
            return
        name, entry = self.entries[row]
        texts = entry_text(entry)
        widgets = (self.name, self.command, self.args, self.url, self.env, self.headers, self.kind)
        for w in widgets:
            w.blockSignals(True)
        self.name.setText(name)
        self.kind.setCurrentText(texts["kind"])
        for key in ("command", "args", "url", "env", "headers"):
            widget = getattr(self, key)
            (widget.setPlainText if isinstance(widget, QPlainTextEdit) else widget.setText)(texts[key])
        for w in widgets:
            w.blockSignals(False)
        self.test_result.setText("")
        self._show_kind()

    def _show_kind(self) -> None:
        stdio = self.kind.currentText() == STDIO
        for widget, show in ((self.command, stdio), (self.args, stdio), (self.env, stdio), (self.url, not stdio),
                             (self.headers, not stdio)):
            self.form.setRowVisible(widget, show)

    def form_entry(self) -> dict:
        """The form as a JSON entry (keys of other apps the entry had kept)."""
        old = self.entries[self.current][1] if 0 <= self.current < len(self.entries) else {}
        entry = {k: v for k, v in old.items() if k not in mcp_config.KNOWN or k == "disabled"}
        if self.kind.currentText() == HTTP:
            entry["url"] = self.url.text().strip()
            if self.headers.toPlainText().strip():
                entry["headers"] = _pairs(self.headers.toPlainText(), ":")
            return entry
        entry["command"] = self.command.text().strip()
        try:
            entry["args"] = shlex.split(self.args.text())
        except ValueError:  # an open quote: the words as typed, said at Save / Test
            entry["args"] = self.args.text().split()
        if self.env.toPlainText().strip():
            entry["env"] = _pairs(self.env.toPlainText(), "=")
        return entry

    def _form_changed(self) -> None:
        if not 0 <= self.current < len(self.entries):
            return
        name = self.name.text()
        self.entries[self.current] = [name, self.form_entry()]
        item = self.list.item(self.current)
        if item is not None and item.text() != name:
            item.setText(name)
        self._show_kind()

    def add_server(self) -> None:
        names = {n for n, _ in self.entries}
        name = next(f"server{i}" if i else "server" for i in range(1000) if (f"server{i}" if i else "server")
                    not in names)
        self.entries.append([name, {"command": "", "args": []}])
        self.list.addItem(name)
        self.form_box.setEnabled(True)
        self.remove_button.setEnabled(True)
        self.list.setCurrentRow(len(self.entries) - 1)
        self.name.setFocus()
        self.name.selectAll()

    def remove_server(self) -> None:
        row = self.list.currentRow()
        if 0 <= row < len(self.entries):
            self.entries.pop(row)
            self.list.takeItem(row)
        self.form_box.setEnabled(bool(self.entries))
        self.remove_button.setEnabled(bool(self.entries))

    # ---- test, save ---------------------------------------------------------------------------------------------
    def parsed(self) -> dict:
        """The servers as entered (McpConfigError names every problem)."""
        names = [n for n, _ in self.entries]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise mcp_config.McpConfigError(f"Two servers are named {', '.join(dupes)}.", "Give each its own name.")
        return mcp_config.parse({"mcpServers": {n: e for n, e in self.entries}}, "The servers")

    def test_connection(self) -> None:
        if not 0 <= self.current < len(self.entries):
            return
        problems: list[str] = []
        name, entry = self.entries[self.current]
        server = mcp_config.parse_server(name, entry, problems)
        if server is None:
            self.test_result.setText("⚠ " + "; ".join(problems) + ".")
            return
        self.test_result.setText(f"Connecting to {name}…")
        self.test_button.setEnabled(False)
        self.test_task = spawn(self._test(server), "mcp-test")

    async def _test(self, server) -> None:
        try:
            tools = await self.tools.host.probe(server)
        except McpError as e:
            self.test_result.setText(f"⚠ {e}")
        except Exception as e:  # noqa: BLE001 (whatever the SDK raised, said in the dialog)
            self.test_result.setText(f"⚠ The test failed: {type(e).__name__}: {e}")
        else:
            names = ", ".join(t.name for t in tools) or "none"
            self.test_result.setText(f"✓ Connected: {len(tools)} tool{'s' if len(tools) != 1 else ''}: {names}")
        finally:
            self.test_button.setEnabled(True)

    def forget_always(self) -> None:
        for server in list(self.tools.approvals.always):
            self.tools.approvals.revoke(server)
        self.forget_button.setEnabled(False)

    def save(self) -> None:
        try:
            servers = self.parsed()
            self.tools.save_servers(servers)
        except mcp_config.McpConfigError as e:
            self.problem.setText(str(e))
            return
        except OSError as e:
            self.problem.setText(f"Could not write {self.tools.path}: {e.strerror or e}.")
            return
        self.tools.set_limits(self.calls.value(), self.timeout.value())
        self.accept()
