"""The model library window (Qt): Find (search the hub, marks, download) and On this computer (the models on disk),
plus the token for gated repositories, kept in the OS keyring. Opened from the launcher's Library… button and from
File ▸ Model library…; Load starts the model, or switches the running engine to it without a restart."""
from __future__ import annotations

import asyncio

from PySide6.QtWidgets import QHBoxLayout, QLabel, QLineEdit, QPushButton, QTabWidget, QVBoxLayout, QWidget

from engine.library.hub import LibraryError

from app import theme
from app.asyncutil import spawn
from app.library.find import FindPanel
from app.library.local import LocalPanel
from app.widgets import remember_size, restore_size


class LibraryWindow(QWidget):
    def __init__(self, controller):
        super().__init__()
        self.controller = controller
        self.setWindowTitle("NInfer — model library")
        self.setWindowIcon(theme.app_icon())
        self.setMinimumSize(640, 420)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(14, 12, 14, 10)
        self.tabs = QTabWidget()
        self.find = FindPanel(controller)
        self.local = LocalPanel(controller)
        self.tabs.addTab(self.find, "Find on Hugging Face")
        self.tabs.addTab(self.local, "On this computer")
        self.find.downloaded.connect(lambda _path: self.local.refresh())
        outer.addWidget(self.tabs, 1)
        row = QHBoxLayout()
        row.addWidget(QLabel("Hugging Face token"))
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setPlaceholderText("for gated or private repositories (hf_…)")
        self.token.returnPressed.connect(self.save_token)
        self.save_token_button = QPushButton("Save token")
        self.save_token_button.clicked.connect(self.save_token)
        self.token_status = QLabel()
        self.token_status.setObjectName("Muted")
        self.token_status.setWordWrap(True)
        row.addWidget(self.token, 1)
        row.addWidget(self.save_token_button)
        row.addWidget(self.token_status, 2)
        outer.addLayout(row)
        restore_size(self, controller.config, "library", (1000, 640))
        self.local.refresh()

    def save_token(self) -> None:
        spawn(self._save_token(self.token.text()), "save-token")

    async def _save_token(self, value: str) -> None:
        from engine.library.token import save_token

        try:
            where = await asyncio.to_thread(save_token, value)  # a keyring may ask the user to unlock it
        except LibraryError as e:
            self.token_status.setText(str(e))
            return
        self.token.clear()
        self.token_status.setText(where)

    def hideEvent(self, event) -> None:
        remember_size(self, self.controller.config, "library")
        super().hideEvent(event)
