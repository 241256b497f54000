"""The dialog that connects the chat to another OpenAI-compatible server (URL and API key)."""
from __future__ import annotations

from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit


class RemoteDialog(QDialog):
    """URL and API key of another OpenAI-compatible server."""

    def __init__(self, parent=None, url: str = "", key: str = ""):
        super().__init__(parent)
        self.setWindowTitle("Connect to a server")
        form = QFormLayout(self)
        note = QLabel("Chat with another OpenAI-compatible server (another NInfer, vLLM, llama.cpp, ...). "
                      "Nothing is loaded on this computer.")
        note.setWordWrap(True)
        form.addRow(note)
        self.url = QLineEdit(url or "http://127.0.0.1:8080/v1")
        self.key = QLineEdit(key)
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("none")
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.key)
        self.error = QLabel()
        self.error.setWordWrap(True)
        form.addRow(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Connect")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
