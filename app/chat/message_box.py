"""The chat's message box: Enter sends, Shift+Enter adds a line; a pasted (or dropped) image goes to the chat's
pending images, not into the text."""
from __future__ import annotations

from PySide6.QtCore import QMimeData, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit

from app.chat.image_tray import offers_images


class MessageBox(QPlainTextEdit):
    """Enter sends, Shift+Enter adds a line."""

    submit = Signal()
    images_offered = Signal(QMimeData)  # a paste or drop of image files or image data (handled at once)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setPlaceholderText("Message the model  (Enter sends, Shift+Enter for a new line)")
        self.setMaximumHeight(96)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                event.modifiers() & Qt.KeyboardModifier.ShiftModifier):
            self.submit.emit()
            return
        super().keyPressEvent(event)

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return offers_images(source) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        if offers_images(source):
            self.images_offered.emit(source)
        else:
            super().insertFromMimeData(source)
