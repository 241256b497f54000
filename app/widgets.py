"""Small widget behaviours the app's forms share (Qt).

``guard_wheel``: spin boxes and combo boxes take the mouse wheel only while they have the keyboard focus, so scrolling
a long form never edits the field under the pointer (the wheel then scrolls the form, as in a browser).
``remember_size`` / ``restore_size``: a window's size kept in the app's state between runs.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import QAbstractSpinBox, QComboBox, QWidget


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


def restore_size(window: QWidget, config, key: str, default: tuple[int, int]) -> None:
    """Resizes ``window`` to the size saved under ``key`` (or ``default``), within the screen."""
    saved = (config.get("window_sizes") or {}).get(key) if config is not None else None
    w, h = default
    if isinstance(saved, list) and len(saved) == 2 and all(isinstance(x, int) and x > 0 for x in saved):
        w, h = saved
    screen = window.screen()
    if screen is not None:
        avail = screen.availableGeometry()
        w, h = min(w, avail.width()), min(h, avail.height())
    window.resize(max(w, window.minimumSizeHint().width(), 200), max(h, 200))


def remember_size(window: QWidget, config, key: str) -> None:
    """Saves ``window``'s size under ``key`` (called when it is hidden or closed)."""
    if config is None or window.isMaximized() or window.isFullScreen():
        return
    sizes = dict(config.get("window_sizes") or {})
    size = [window.width(), window.height()]
    if sizes.get(key) != size:
        sizes[key] = size
        config.set("window_sizes", sizes)


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
