"""The conversation list: search (titles and message text, saying when nothing matches), newest first, new, rename,
delete (Rename and Delete only while a conversation is selected). The conversations themselves live in SQLite
(app/chat/store.py)."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QHBoxLayout, QInputDialog, QLabel, QLineEdit, QListWidget, QListWidgetItem, QMenu,
                               QMessageBox, QPushButton, QVBoxLayout, QWidget)

PROMPT_TITLE_CHARS = 80  # a title in a prompt is cut at a word boundary after this many characters


def short_title(title: str, limit: int = PROMPT_TITLE_CHARS) -> str:
    """``title`` cut at a word boundary (never mid-word) with an ellipsis when longer than ``limit``."""
    title = " ".join(title.split())
    if len(title) <= limit:
        return title
    cut = title[:limit + 1].rsplit(" ", 1)[0] if " " in title[:limit + 1] else title[:limit]
    return cut.rstrip(" ,.;:-") + "…"

from app.chat.store import ConversationStore


class ConversationList(QWidget):
    """Search, list (newest first), new, rename, delete."""

    selected = Signal(int)
    new_requested = Signal()

    def __init__(self, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.store = store
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.new_button = QPushButton("+  New chat")
        self.new_button.setObjectName("Primary")
        self.new_button.clicked.connect(self.new_requested)
        layout.addWidget(self.new_button)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations…")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda: self.refresh(self.current_id()))
        layout.addWidget(self.search)
        self.list = QListWidget()
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.itemSelectionChanged.connect(lambda: self._update_buttons())
        self.list.itemDoubleClicked.connect(lambda item: self.rename(item.data(Qt.ItemDataRole.UserRole)))
        layout.addWidget(self.list, 1)
        self.empty = QLabel()
        self.empty.setObjectName("Muted")
        self.empty.setWordWrap(True)
        self.empty.setVisible(False)
        layout.addWidget(self.empty)
        row = QHBoxLayout()
        self.rename_button = QPushButton("Rename")
        self.rename_button.clicked.connect(lambda: self.rename(self.current_id()))
        self.delete_button = QPushButton("Delete")
        self.delete_button.setObjectName("Danger")
        self.delete_button.clicked.connect(lambda: self.delete(self.current_id()))
        for b in (self.rename_button, self.delete_button):
            b.setProperty("compact", True)  # both fit beside each other in a narrow list
            row.addWidget(b)
        layout.addLayout(row)
        self.confirm_delete = lambda title: QMessageBox.question(
            self, "Delete conversation", f"Delete “{short_title(title)}”?\n\nThis cannot be undone.") \
            == QMessageBox.StandardButton.Yes
        self.ask_title = self._ask_title
        self._update_buttons()

    def rename_dialog(self, title: str) -> QInputDialog:
        dialog = QInputDialog(self)
        dialog.setWindowTitle("Rename conversation")
        dialog.setLabelText("New title:")
        dialog.setTextValue(title)
        dialog.setMinimumWidth(420)  # room for the title bar's text and a long title
        dialog.resize(max(420, dialog.sizeHint().width()), dialog.sizeHint().height())
        return dialog

    def _ask_title(self, title: str) -> tuple[str, bool]:
        dialog = self.rename_dialog(title)
        ok = dialog.exec() == QInputDialog.DialogCode.Accepted
        return dialog.textValue(), ok

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item else None

    def refresh(self, select: int | None = None) -> None:
        self.list.blockSignals(True)
        self.list.clear()
        for conv in self.store.list(self.search.text()):
            item = QListWidgetItem(conv.title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setToolTip(conv.title)
            self.list.addItem(item)
            if conv.id == select:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        query = self.search.text().strip()
        self.empty.setText(f"No conversation matches “{short_title(query, 40)}”." if query else "")
        self.empty.setVisible(bool(query) and self.list.count() == 0)
        self._update_buttons()

    def _update_buttons(self) -> None:
        selected = self.list.currentItem() is not None and self.list.currentItem().isSelected()
        self.rename_button.setEnabled(selected)
        self.delete_button.setEnabled(selected)

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def _current_changed(self, current, _previous) -> None:
        self._update_buttons()
        if current is not None:
            self.selected.emit(current.data(Qt.ItemDataRole.UserRole))

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename(cid))
        menu.addAction("Delete", lambda: self.delete(cid))
        menu.exec(self.list.mapToGlobal(pos))

    def rename(self, cid: int | None) -> None:
        conv = self.store.get(cid) if cid is not None else None
        if conv is None:
            return
        title, ok = self.ask_title(conv.title)
        if ok and title.strip():
            self.store.rename(cid, title)
            self.refresh(cid)

    def delete(self, cid: int | None) -> None:
        conv = self.store.get(cid) if cid is not None else None
        if conv is None or not self.confirm_delete(conv.title):
            return
        self.store.delete(cid)
        self.refresh()
        if self.list.count():
            self.list.setCurrentRow(0)
        else:
            self.new_requested.emit()
