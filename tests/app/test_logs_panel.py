"""The Logs tab names the log file: a long data folder is elided in the middle, not a reason for the window to grow
(it made the main window 808 px wide, past an 800 x 600 screen, for a home folder 30 characters longer)."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication

from app import paths
from app.server.logs import LogsPanel, QtLogHandler


def test_a_long_log_path_is_elided_and_copied_whole(qtbot, monkeypatch, tmp_path):
    deep = tmp_path / ("a-very-long-folder-name-" * 8) / "data"
    monkeypatch.setattr(paths, "data_dir", lambda: deep)
    whole = str(deep / "logs" / "ninfer.log")
    panel = LogsPanel(QtLogHandler())
    qtbot.addWidget(panel)
    assert panel.path.fontMetrics().horizontalAdvance(whole) > 1000  # the path alone wider than the window
    assert panel.minimumSizeHint().width() <= 400
    panel.resize(600, 300)
    panel.show()
    qtbot.waitUntil(lambda: panel.path.width() > 0)
    shown = panel.path.text()
    assert shown.startswith("Also written to ") and "…" in shown and shown.endswith("ninfer.log"), shown
    assert panel.path.fontMetrics().horizontalAdvance(shown) <= panel.path.width()
    assert panel.path.toolTip() == whole
    qtbot.mouseClick(panel.copy_path, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == whole
    panel.resize(2400, 300)
    qtbot.waitUntil(lambda: panel.path.text() == "Also written to " + whole)

