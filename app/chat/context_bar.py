"""Under the chat's input: the context bar (the conversation's tokens against the model's context window), the
text files attached to the next message (their text goes into the prompt and counts against the context) and the
Attach image… button (the images themselves wait above the message box, app/chat/image_tray.py)."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget

from app.chat import context
from app.chat.images import IMAGE_SUFFIXES, ImageRefused, read_image_file
from app.widgets import last_folder, remember_folder

MAX_ATTACHMENT_BYTES = 2_000_000


def read_text_file(path: str) -> str:
    """The text of a file to attach; ValueError says why it cannot be (too big, not text)."""
    p = Path(path)
    size = p.stat().st_size
    if size > MAX_ATTACHMENT_BYTES:
        raise ValueError(f"{p.name} is {size / 1e6:.1f} MB; attach a text file under {MAX_ATTACHMENT_BYTES / 1e6:.0f} "
                         f"MB (or paste the part that matters).")
    data = p.read_bytes()
    if b"\0" in data[:4096]:
        raise ValueError(f"{p.name} is not a text file; attach text (code, notes, CSV, Markdown…).")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


CANNOT_ATTACH = "⚠ Cannot attach: "

class ContextBar(QWidget):
    """``chat`` gives controller (context_window()), max_tokens, chars_per_token."""

    changed = Signal()  # attachments changed

    def __init__(self, chat, parent=None):
        super().__init__(parent)
        self.chat = chat
        self.attachments: list[tuple[str, str]] = []  # (file name, text)
        self.ask_file = lambda: QFileDialog.getOpenFileName(self, "Attach a text file",
                                                            str(last_folder(self._config(), "attach")))[0]
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.attach_button = QPushButton("Attach file…")
        self.attach_button.setToolTip("Put a text file's contents into the next message")
        self.attach_button.clicked.connect(self.attach)
        layout.addWidget(self.attach_button)
        self.image_button = QPushButton("Attach image…")
        self.image_button.setToolTip("Send images with the next message (PNG, JPEG, WebP, GIF; also pasted with "
                                     "Ctrl+V or dropped on the chat) to a model that reads images")
        self.image_button.clicked.connect(lambda: self.chat.attach_image_files())
        layout.addWidget(self.image_button)
        self.files = QLabel()
        self.files.setObjectName("Muted")
        self.files.setWordWrap(True)
        layout.addWidget(self.files, 1)
        self.clear_button = QPushButton("Remove")
        self.clear_button.setToolTip("Remove the attached files")
        self.clear_button.clicked.connect(self.clear_attachments)
        self.clear_button.setVisible(False)
        layout.addWidget(self.clear_button)
        tip = ("The conversation's tokens (estimated from its characters, calibrated by the server's count) of the "
               "model's context window. When it is full, the oldest turns are left out, and the chat says so.")
        self.label = QLabel()
        self.label.setObjectName("Muted")
        self.label.setToolTip(tip)
        layout.addWidget(self.label)
        self.bar = QProgressBar()
        self.bar.setObjectName("ContextBar")
        self.bar.setTextVisible(False)
        self.bar.setFixedWidth(110)
        self.bar.setMaximumHeight(8)
        self.bar.setToolTip(tip)
        layout.addWidget(self.bar)
        self.used = 0

    def _config(self):
        return getattr(self.chat.controller, "config", None)

    @property
    def window(self) -> int | None:
        getter = getattr(self.chat.controller, "context_window", None)
        return getter() if getter is not None else None

    # ---- attachments ---------------------------------------------------------------------------------------------
    def attach(self, path: str | None = None) -> str | None:
        """Attaches a text file; returns what went wrong (also shown), or None."""
        path = path or self.ask_file()
        if not path:
            return None
        if Path(path).suffix.lower() in IMAGE_SUFFIXES:  # an image goes with the message as an image, not as text
            try:
                image = read_image_file(Path(path))
            except ImageRefused:
                image = None  # not an image after all: said as a file that is not text, below
            if image is not None:
                return None if self.chat.attach_images([image]) else self.chat.notice.text()
        try:
            text = read_text_file(path)
        except (OSError, ValueError) as e:
            self.chat.notice.setText(f"{CANNOT_ATTACH}{e}")
            self.chat.notice.setVisible(True)
            return str(e)
        self.attachments.append((Path(path).name, text))
        remember_folder(self._config(), "attach", path)
        if self.chat.notice.text().startswith(CANNOT_ATTACH):  # an earlier refusal is no longer the news
            self.chat.notice.setVisible(False)
        self._show_files()
        return None

    def clear_attachments(self) -> None:
        self.attachments.clear()
        self._show_files()

    def _show_files(self) -> None:
        self.files.setText("📎 " + ", ".join(f"{name} (~{context.estimate_tokens(text, self.chat.chars_per_token):,}"
                                            f" tokens)" for name, text in self.attachments) if self.attachments else "")
        self.clear_button.setVisible(bool(self.attachments))
        self.changed.emit()

    def with_attachments(self, text: str) -> str:
        parts = [text] + [f"**{name}**\n```\n{body.rstrip()}\n```" for name, body in self.attachments]
        return "\n\n".join(p for p in parts if p)

    def too_long(self, text: str) -> str | None:
        """Why ``text`` cannot be sent as the next message (it alone outgrows the context), or None."""
        window = self.window
        if not window:
            return None
        system = self.chat.system_prompt.toPlainText().strip()
        alone = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        fit = context.fit(alone, window, self.chat.max_tokens, self.chat.chars_per_token)
        if fit.fits:
            return None
        room = window - context.answer_reserve(window, self.chat.max_tokens)
        what = "This message with its attachments" if self.attachments else "This message"
        return (f"⚠ {what} is about {fit.tokens:,} tokens (estimated), but the model's context holds {window:,} "
                f"tokens with {window - room:,} kept for the answer: the server may refuse it. If it does, shorten it "
                f"or attach less, or start the model with a longer context (Change model or settings… › Context "
                f"length).")

    # ---- the bar -------------------------------------------------------------------------------------------------
    def show_usage(self, messages: list[dict]) -> None:
        window = self.window
        tokens = sum(context.message_tokens(m, self.chat.chars_per_token) for m in messages)
        self.used = tokens
        if not window:
            self.bar.setRange(0, 1)
            self.bar.setValue(0)
            self.bar.setVisible(False)
            self.label.setText(f"Context: ~{tokens:,} tokens")
            return
        self.bar.setVisible(True)
        self.bar.setRange(0, window)
        self.bar.setValue(min(tokens, window))
        self.label.setText(f"Context: ~{tokens:,} / {window:,} tokens" + (" · full: the oldest turns are left out"
                                                                          if tokens > window else ""))
