"""The logs view: the engine's, the server's and the app's log records, live, and in a rotating file under the
user's data dir (logs/ninfer.log) so a problem can be read after the fact."""
from __future__ import annotations

import logging
import logging.handlers
from collections import deque

from PySide6.QtCore import QObject, QSize, Qt, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QSizePolicy, QVBoxLayout,
                               QWidget)

from app import paths

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
LOGGERS = ("ninfer", "uvicorn", "uvicorn.error", "uvicorn.access")


class QuietPolls(logging.Filter):
    """Drops the access-log lines of the app's own once-a-second read of the server's mode (GET
    /ninfer/v1/settings answered 200): they would bury everything else in the Logs tab."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.name == "uvicorn.access" and len(args) >= 5 and args[1] == "GET"
                    and str(args[2]).startswith("/ninfer/v1/settings") and args[4] == 200)


class _Emitter(QObject):
    record = Signal(str, int)


class QtLogHandler(logging.Handler):
    """Forwards records from any thread to the GUI thread through a queued signal."""

    def __init__(self, keep: int = 5000):
        super().__init__()
        self.emitter = _Emitter()
        self.recent: deque[tuple[str, int]] = deque(maxlen=keep)  # for a view opened later (the model loads first)
        self.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            self.recent.append((line, record.levelno))
            self.emitter.record.emit(line, record.levelno)
        except RuntimeError:  # the emitter is gone (app shutting down)
            pass


_handler: QtLogHandler | None = None
_installed: list[logging.Handler] = []
_saved_levels: dict[str, int] = {}


def install(level: int = logging.INFO) -> QtLogHandler:
    """Attaches the Qt handler and a rotating file handler once; returns the Qt handler."""
    global _handler
    if _handler is not None:
        return _handler
    _handler = QtLogHandler()
    _handler.addFilter(QuietPolls())
    root = logging.getLogger()
    root.addHandler(_handler)
    _installed.append(_handler)
    try:
        folder = paths.data_dir() / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        file_handler = logging.handlers.RotatingFileHandler(folder / "ninfer.log", maxBytes=2_000_000, backupCount=3,
                                                            encoding="utf-8")
        file_handler.setFormatter(logging.Formatter(FORMAT))
        file_handler.addFilter(QuietPolls())
        root.addHandler(file_handler)
        _installed.append(file_handler)
    except OSError:
        pass
    for name in ("", *LOGGERS, "httpx"):
        _saved_levels[name] = logging.getLogger(name).level
    if root.level > level or root.level == logging.NOTSET:
        root.setLevel(level)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return _handler


def uninstall() -> None:
    """Takes the handlers off again and restores the levels (for tests that share the process)."""
    global _handler
    root = logging.getLogger()
    for h in _installed:
        root.removeHandler(h)
        h.close()
    _installed.clear()
    for name, lvl in _saved_levels.items():
        logging.getLogger(name).setLevel(lvl)
    _saved_levels.clear()
    _handler = None


class PathLabel(QLabel):
    """``prefix`` and a file's path, the path elided in the middle to the width the label gets (the whole path in
    its tooltip): a long home folder does not widen the window."""

    def __init__(self, prefix: str, path: str):
        super().__init__()
        self.prefix, self.path = prefix, path
        self.setToolTip(path)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setText(prefix + path)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        hint = super().minimumSizeHint()
        hint.setWidth(self.fontMetrics().horizontalAdvance(self.prefix + "…/ninfer.log"))
        return hint

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        room = self.contentsRect().width() - self.fontMetrics().horizontalAdvance(self.prefix)
        self.setText(self.prefix + self.fontMetrics().elidedText(self.path, Qt.TextElideMode.ElideMiddle, room))
        super().resizeEvent(event)


class LogsPanel(QWidget):
    def __init__(self, handler: QtLogHandler, parent=None):
        super().__init__(parent)
        layout = QVBoxLayout(self)
        bar = QHBoxLayout()
        title = QLabel("Logs")
        title.setObjectName("Section")
        bar.addWidget(title)
        bar.addStretch(1)
        self.follow = QCheckBox("Follow")
        self.follow.setChecked(True)
        bar.addWidget(self.follow)
        copy = QPushButton("Copy all")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.view.toPlainText()))
        bar.addWidget(copy)
        clear = QPushButton("Clear")
        clear.clicked.connect(lambda: self.view.clear())
        bar.addWidget(clear)
        layout.addLayout(bar)
        self.view = QPlainTextEdit()
        self.view.setReadOnly(True)
        self.view.setMaximumBlockCount(5000)
        self.view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        layout.addWidget(self.view, 1)
        file = str(paths.data_dir() / "logs" / "ninfer.log")
        self.path = PathLabel("Also written to ", file)
        self.path.setObjectName("Muted")
        self.copy_path = QPushButton("Copy path")
        self.copy_path.setToolTip("Copy the log file's path")
        self.copy_path.clicked.connect(lambda: QGuiApplication.clipboard().setText(file))
        row = QHBoxLayout()
        row.addWidget(self.path, 1)
        row.addWidget(self.copy_path)
        layout.addLayout(row)
        for line, level in list(handler.recent):
            self.append(line, level)
        handler.emitter.record.connect(self.append)

    def append(self, line: str, level: int) -> None:
        self.view.appendPlainText(line)
        if self.follow.isChecked():
            bar = self.view.verticalScrollBar()
            bar.setValue(bar.maximum())
