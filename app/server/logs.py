"""The logs view: the engine's, the server's and the app's log records, live, and in a rotating file under the
user's data dir (logs/ninfer.log) so a problem can be read after the fact."""
from __future__ import annotations

import logging
import logging.handlers
from collections import deque

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget)

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
        path = QLabel(f"Also written to {paths.data_dir() / 'logs' / 'ninfer.log'}")
        path.setObjectName("Muted")
        path.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(path)
        for line, level in list(handler.recent):
            self.append(line, level)
        handler.emitter.record.connect(self.append)

    def append(self, line: str, level: int) -> None:
        self.view.appendPlainText(line)
        if self.follow.isChecked():
            bar = self.view.verticalScrollBar()
            bar.setValue(bar.maximum())
