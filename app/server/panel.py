"""The server panel: the API's URL, port and key, opening it to the local network (only with a key) with the addresses
other computers use, examples ready to paste, starting and stopping the engine, and chatting with another server.

The form shows the running server's values until the user edits it; from then on the periodic refresh leaves the
form alone (the running values stay in the status line) until Apply or Revert."""
from __future__ import annotations

import secrets

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from app import client as api
from app.asyncutil import spawn
from app.widgets import guard_wheel

LAN_HOST = "0.0.0.0"


def curl_example(api_url: str, model: str, key: str | None) -> str:
    auth = f" \\\n  -H 'Authorization: Bearer {key}'" if key else ""
    return (f"curl {api_url}/chat/completions \\\n  -H 'Content-Type: application/json'{auth} \\\n"
            f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")


def python_example(api_url: str, model: str, key: str | None) -> str:
    return ("from openai import OpenAI\n"
            f"client = OpenAI(base_url=\"{api_url}\", api_key=\"{key or 'none'}\")\n"
            f"for chunk in client.chat.completions.create(model=\"{model}\", stream=True,\n"
            "        messages=[{\"role\": \"user\", \"content\": \"Tell me a joke.\"}]):\n"
            "    print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)\n")


def _code_box(text: str = "") -> QPlainTextEdit:
    box = QPlainTextEdit(text)
    box.setReadOnly(True)
    box.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
    box.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
    box.setMaximumHeight(120)
    return box


class ServerPanel(QWidget):
    def __init__(self, controller, parent=None):
        super().__init__(parent)
        self.controller = controller
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        outer.addWidget(scroll)
        body = QWidget()
        scroll.setWidget(body)
        layout = QVBoxLayout(body)

        self.status = QLabel()
        self.status.setObjectName("Section")
        self.status.setWordWrap(True)
        layout.addWidget(self.status)

        api = QGroupBox("API")
        form = QFormLayout(api)
        url_row = QHBoxLayout()
        self.url = QLineEdit()
        self.url.setReadOnly(True)
        copy_url = QPushButton("Copy")
        copy_url.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.url.text()))
        url_row.addWidget(self.url, 1)
        url_row.addWidget(copy_url)
        form.addRow("Base URL", url_row)
        self.lan_urls = QLabel()
        self.lan_urls.setWordWrap(True)
        self.lan_urls.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.lan_urls.setVisible(False)
        form.addRow("", self.lan_urls)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setMaximumWidth(140)
        guard_wheel(self.port)
        form.addRow("Port", self.port)
        key_row = QHBoxLayout()
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("none: no key needed (this computer only)")
        show = QPushButton("Show")
        show.setCheckable(True)
        show.toggled.connect(lambda on: self.key.setEchoMode(QLineEdit.EchoMode.Normal if on
                                                             else QLineEdit.EchoMode.Password))
        generate = QPushButton("Generate")
        generate.clicked.connect(lambda: self.key.setText("sk-ninfer-" + secrets.token_urlsafe(24)))
        copy_key = QPushButton("Copy")
        copy_key.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.key.text()))
        key_row.addWidget(self.key, 1)
        for b in (show, generate, copy_key):
            key_row.addWidget(b)
        form.addRow("API key", key_row)
        self.lan = QCheckBox("Allow other computers on the network (needs an API key)")
        self.lan.setToolTip("Listen on all network interfaces (0.0.0.0) instead of this computer only. Anyone on the "
                            "network who has the key can use the model.")
        form.addRow("", self.lan)
        apply_row = QHBoxLayout()
        self.apply_note = QLabel()
        self.apply_note.setWordWrap(True)
        self.apply_note.setObjectName("Muted")
        self.apply_button = QPushButton("Apply")
        self.apply_button.setObjectName("Primary")
        self.apply_button.clicked.connect(self.apply)
        self.revert_button = QPushButton("Revert")
        self.revert_button.setToolTip("Show the running server's values again")
        self.revert_button.clicked.connect(self.revert)
        apply_row.addWidget(self.apply_note, 1)
        apply_row.addWidget(self.revert_button)
        apply_row.addWidget(self.apply_button)
        form.addRow(apply_row)
        self.result_note = ""  # what the last Apply did; shown until the form is edited
        self.shown: tuple | None = None  # (port, lan, key) last copied from the running server into the form
        for signal in (self.port.valueChanged, self.key.textChanged, self.lan.toggled):
            signal.connect(self._edited)
        layout.addWidget(api)

        engine = QGroupBox("Engine on this computer")
        el = QVBoxLayout(engine)
        self.engine_info = QLabel()
        self.engine_info.setWordWrap(True)
        self.engine_info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        el.addWidget(self.engine_info)
        er = QHBoxLayout()
        self.server_button = QPushButton("Stop server")
        self.server_button.clicked.connect(self.controller.toggle_server)
        change = QPushButton("Change model or settings…")
        change.clicked.connect(lambda: spawn(self.controller.back_to_launcher()))
        er.addWidget(self.server_button)
        er.addWidget(change)
        er.addStretch(1)
        el.addLayout(er)
        layout.addWidget(engine)

        remote = QGroupBox("Chat with another server")
        rf = QFormLayout(remote)
        note = QLabel("Any OpenAI-compatible server: another NInfer, vLLM, llama.cpp, a cloud API. The engine on "
                      "this computer keeps running.")
        note.setWordWrap(True)
        note.setObjectName("Muted")
        rf.addRow(note)
        self.remote_url = QLineEdit()
        self.remote_url.setPlaceholderText("http://192.168.1.20:8080/v1")
        self.remote_key = QLineEdit()
        self.remote_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.remote_key.setPlaceholderText("none")
        rf.addRow("URL", self.remote_url)
        rf.addRow("API key", self.remote_key)
        rr = QHBoxLayout()
        self.remote_note = QLabel()
        self.remote_note.setWordWrap(True)
        connect = QPushButton("Connect")
        connect.clicked.connect(self.connect_remote)
        self.local_button = QPushButton("Use this computer's engine")
        self.local_button.clicked.connect(self.controller.use_local)
        rr.addWidget(self.remote_note, 1)
        rr.addWidget(connect)
        rr.addWidget(self.local_button)
        rf.addRow(rr)
        layout.addWidget(remote)

        examples = QGroupBox("Use it from your code")
        xl = QVBoxLayout(examples)
        self.curl = _code_box()
        self.python = _code_box()
        for title, box in (("curl", self.curl), ("Python (openai package)", self.python)):
            row = QHBoxLayout()
            label = QLabel(title)
            label.setObjectName("Muted")
            copy = QPushButton("Copy")
            copy.clicked.connect(lambda _=False, b=box: QGuiApplication.clipboard().setText(b.toPlainText()))
            row.addWidget(label, 1)
            row.addWidget(copy)
            xl.addLayout(row)
            xl.addWidget(box)
        layout.addWidget(examples)
        layout.addStretch(1)
        self.refresh()

    # ---- showing -----------------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        c = self.controller
        s = c.service
        endpoint = c.endpoint
        if c.remote and endpoint is not None:
            self.status.setText(f"Chatting with {endpoint.api_url}")
        elif s is None:
            self.status.setText("The engine is stopped.")
        else:
            self.status.setText({"ready": "Serving", "loading": "Loading the model…"}.get(s.status, s.status.title())
                                + (f" on {s.url}" if s.serving else "")
                                + (" and to the network" if s.serving and s.host == LAN_HOST else ""))
        if s is not None:
            self.url.setText(s.url)
            if not self.edited:  # never overwrite what the user is typing
                self._show_running(s)
            lan = api.lan_addresses() if s.host == LAN_HOST and s.serving else []
            self.lan_urls.setText("From other computers: " + "  ·  ".join(f"http://{a}:{s.port}/v1" for a in lan)
                                  if lan else "")
            self.lan_urls.setVisible(bool(lan))
            stats = s.stats()
            self.engine_info.setText(
                f"Model: {', '.join(s.model_ids)}  ({s.model_path})\nDevice: {stats.get('device') or '—'} · "
                f"context {stats.get('context_window') or '—'} tokens · mode {stats.get('mode')}")
        key = s.api_key if s is not None else None
        model = c.model_id or "model"
        api_url = (api.shared_url(s) if s is not None and not c.remote else endpoint.api_url if endpoint else "")
        if c.remote and endpoint is not None:
            key = endpoint.api_key
        self.curl.setPlainText(curl_example(api_url, model, key))
        self.python.setPlainText(python_example(api_url, model, key))
        self.server_button.setText("Stop server" if s is not None and s.serving else "Start server")
        self.server_button.setEnabled(c.can_toggle_server)
        self.local_button.setEnabled(c.remote)
        self._check_form()

    def running_values(self, s) -> tuple:
        return (s.port, s.host == LAN_HOST, s.api_key or "")

    def form_values(self) -> tuple:
        return (self.port.value(), self.lan.isChecked(), self.key.text())

    @property
    def edited(self) -> bool:
        """The user changed the form since it last showed the running server's values."""
        return self.shown is not None and self.form_values() != self.shown

    def _show_running(self, s) -> None:
        values = self.running_values(s)
        for w in (self.port, self.lan, self.key):
            w.blockSignals(True)
        self.port.setValue(values[0])
        self.lan.setChecked(values[1])
        if self.key.text() != values[2]:
            self.key.setText(values[2])
        for w in (self.port, self.lan, self.key):
            w.blockSignals(False)
        self.shown = values

    def revert(self) -> None:
        self.shown = None
        self.result_note = ""
        self.refresh()

    def _edited(self, *_args) -> None:
        self.result_note = ""
        self._check_form()

    def _check_form(self) -> None:
        s = self.controller.service
        self.revert_button.setVisible(self.edited)
        if s is None:
            self.apply_button.setEnabled(False)
            self.apply_note.setText("Start the engine first.")
            return
        key = self.key.text().strip() or None
        changed = self.lan.isChecked() != (s.host == LAN_HOST) or self.port.value() != s.port or key != s.api_key
        if self.lan.isChecked() and not key:
            self.apply_button.setEnabled(False)
            self.apply_note.setText("⚠ Opening the API to the network needs an API key: type one or press Generate.")
            return
        self.apply_button.setEnabled(changed and s.status == "ready")
        if self.result_note:
            self.apply_note.setText(self.result_note)
        elif changed:
            self.apply_note.setText(f"Not applied yet: the server runs on port {s.port}"
                                    f"{' for the network' if s.host == LAN_HOST else ' for this computer only'}"
                                    f"{' with a key' if s.api_key else ''}. Apply restarts the API (the model stays "
                                    f"loaded).")
        elif self.lan.isChecked():
            self.apply_note.setText("Clients on the network connect to this computer's address with the key.")
        else:
            self.apply_note.setText("Changes restart the API (the model stays loaded).")

    # ---- actions -----------------------------------------------------------------------------------------------------
    def apply(self) -> None:
        s = self.controller.service
        if s is None:
            return
        host = LAN_HOST if self.lan.isChecked() else (s.host if s.host != LAN_HOST else "127.0.0.1")
        spawn(self._apply(host, self.port.value(), self.key.text().strip() or None))

    async def _apply(self, host: str, port: int, key: str | None) -> None:
        self.apply_button.setEnabled(False)
        error = await self.controller.restart_server(host, port, key)
        self.result_note = f"⚠ {error}" if error else "Applied."
        if not error:
            self.shown = None  # show what now runs
        self.refresh()

    def connect_remote(self) -> None:
        spawn(self._connect(self.remote_url.text().strip(), self.remote_key.text().strip() or None))

    async def _connect(self, url: str, key: str | None) -> None:
        self.remote_note.setText("Connecting…")
        error = await self.controller.connect_remote(url, key)
        self.remote_note.setText(f"⚠ {error}" if error else "Connected.")
