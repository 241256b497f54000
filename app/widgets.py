"""Small widget behaviours the app's forms share (Qt).

``guard_wheel``: spin boxes and combo boxes take the mouse wheel only while they have the keyboard focus, so scrolling
a long form never edits the field under the pointer (the wheel then scrolls the form, as in a browser).
``remember_size`` / ``restore_size``: a window's size and position kept between runs, fitted to the screen.
``FormScrollArea``: a scroll area that scrolls vertically only and is never narrower than its widget.
``breakable``: text a word-wrapped label may break inside long names (paths, tensor names).
``NamedRowsTable``: a table whose first column (a name) takes the room the others leave, never less than a minimum.
"""
from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtCore import QEvent, QMargins, QObject, QPoint, QRect, QSize, Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QAbstractSpinBox, QComboBox, QHeaderView, QScrollArea, QTableWidget, QWidget


class _WheelGuard(QObject):
    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt's name)
        if event.type() == QEvent.Type.Wheel and isinstance(obj, QWidget) and not obj.hasFocus():
            event.ignore()  # the parent (the scroll area) scrolls instead
            return True
        return False


_GUARD = _WheelGuard()


def guard_wheel(*widgets: QWidget) -> None:
    """Spin boxes and combo boxes among ``widgets`` (and their children) ignore the wheel unless focused."""
    for root in widgets:
        found = [root] + root.findChildren(QWidget)
        for w in found:
            if isinstance(w, (QAbstractSpinBox, QComboBox)):
                w.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # not WheelFocus: the wheel must not take focus
                w.installEventFilter(_GUARD)


class FormScrollArea(QScrollArea):
    """Scrolls its widget vertically only; its minimum width (which a splitter keeps) is the widget's minimum width
    plus the vertical scroll bar, so no part of the widget hides beyond the right edge or under a scroll bar."""

    def __init__(self, widget: QWidget, min_width: int = 0):
        super().__init__()
        self.floor = min_width
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWidget(widget)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        hint = super().minimumSizeHint()
        widget = self.widget()
        if widget is not None:
            need = widget.minimumSizeHint().width() + self.verticalScrollBar().sizeHint().width() \
                + 2 * self.frameWidth()
            hint.setWidth(max(hint.width(), need, self.floor))
        return hint

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt's name)
        if obj is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            self.updateGeometry()  # rows shown or hidden: the splitter asks the minimum width again
        return super().eventFilter(obj, event)


class NamedRowsTable(QTableWidget):
    """The first column gets the width the other columns (sized to their contents) leave, but at least
    ``name_width`` pixels: on a narrow window the table scrolls sideways instead of cutting every name to a letter."""

    def __init__(self, columns: tuple[str, ...], name_width: int = 220):
        super().__init__(0, len(columns))
        self.name_width = name_width
        self.setHorizontalHeaderLabels(columns)
        header = self.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Interactive)
        for c in range(1, len(columns)):
            header.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        header.sectionResized.connect(lambda index, *_: index and self.fit_name())

    def fit_name(self) -> None:
        others = sum(self.columnWidth(c) for c in range(1, self.columnCount()))
        self.setColumnWidth(0, max(self.name_width, self.viewport().width() - others))

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self.fit_name()


def breakable(text: str) -> str:
    """``text`` with a break opportunity (a zero-width space) after each dot, underscore and slash, so a word-wrapped
    label wraps a long tensor name or path instead of cutting it off."""
    return re.sub(r"([._/\\])(?=\w)", "\\1\u200b", text)


# The title bar and borders a window manager draws around a window: Qt knows them only once the window is shown.
DECORATION = QMargins(4, 32, 4, 4)


def _saved(config, group: str, key: str, positive: bool) -> tuple[int, int] | None:
    value = (config.get(group) or {}).get(key) if config is not None else None
    if isinstance(value, list) and len(value) == 2 and all(type(x) is int and (x > 0 or not positive) for x in value):
        return value[0], value[1]
    return None


def restore_size(window: QWidget, config, key: str, default: tuple[int, int]) -> None:
    """Resizes ``window`` to the size saved under ``key`` (or ``default``) and moves it to the position saved with
    it, within the available area of its screen (the screen less panels and docks) with room for the title bar:
    a window saved partly off-screen, or bigger than this screen, comes back whole."""
    w, h = _saved(config, "window_sizes", key, positive=True) or default
    pos = _saved(config, "window_positions", key, positive=False)
    w, h = max(w, window.minimumSizeHint().width(), 200), max(h, 200)
    screen = QGuiApplication.screenAt(QRect(QPoint(*pos), QSize(w, h)).center()) if pos else None
    screen = screen or window.screen()
    if screen is None:
        window.resize(w, h)
        return
    outer, inner = window.frameGeometry(), window.geometry()
    margins = QMargins(inner.left() - outer.left(), inner.top() - outer.top(), outer.right() - inner.right(),
                       outer.bottom() - inner.bottom())
    margins = DECORATION if margins.isNull() else margins
    room = screen.availableGeometry().marginsRemoved(margins)  # where the window's inside may go on this screen
    window.resize(min(w, room.width()), min(h, room.height()))  # (never below the window's minimum size)
    if pos is not None:
        x = max(room.left(), min(pos[0] + margins.left(), room.right() + 1 - window.width()))
        y = max(room.top(), min(pos[1] + margins.top(), room.bottom() + 1 - window.height()))
        window.move(x - margins.left(), y - margins.top())


def remember_size(window: QWidget, config, key: str) -> None:
    """Saves ``window``'s size and position under ``key`` (called when it is hidden or closed)."""
    if config is None or window.isMaximized() or window.isFullScreen():
        return
    for group, value in (("window_sizes", [window.width(), window.height()]),
                         ("window_positions", [window.x(), window.y()])):
        saved = dict(config.get(group) or {})
        if saved.get(key) != value:
            saved[key] = value
            config.set(group, saved)


def last_folder(config, key: str) -> Path:
    """Where a file dialog of this kind (``key``: "attach", "conversations") opens: the folder it last used, else the
    home folder."""
    folder = (config.get("last_folders") or {}).get(key) if config is not None else None
    return Path(folder) if isinstance(folder, str) and Path(folder).is_dir() else Path.home()


def remember_folder(config, key: str, path: str | Path) -> None:
    """The folder of ``path``, for the next dialog of this kind."""
    if config is None or not path:
        return
    folders = dict(config.get("last_folders") or {})
    folders[key] = str(Path(path).parent)
    config.set("last_folders", folders)
