"""Light and dark looks that follow the system: a Fusion palette, one style sheet with the palette's colours filled
in, the app icon, and the matching colours for the chat transcript's HTML."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QIcon, QPalette, QPixmap, QPainter
from PySide6.QtWidgets import QApplication

from app import paths


LIGHT = {"window": "#f6f7fb", "surface": "#ffffff", "input": "#ffffff", "border": "#d9dce3", "text": "#1f2328",
         "muted": "#656d76", "accent": "#4f46e5", "accent_hover": "#4338ca", "accent_soft": "#e0e7ff",
         "on_accent": "#ffffff", "pressed": "#eef0f5", "disabled": "#9aa1ab", "disabled_bg": "#c7cad1",
         "error": "#b42318", "warning": "#b54708", "ok": "#067647", "info": "#175cd3",
         "banner": "#fffaeb", "banner_border": "#fedf89",
         "plot_bg": "#ffffff", "plot_fg": "#475467", "series1": "#4f46e5", "series2": "#12b76a", "series3": "#f79009",
         "series4": "#c026d3", "series5": "#0284c7", "series6": "#475467"}
DARK = {"window": "#0f1115", "surface": "#171a21", "input": "#1d2129", "border": "#2e3440", "text": "#e6edf3",
        "muted": "#8d96a0", "accent": "#818cf8", "accent_hover": "#a5b4fc", "accent_soft": "#2b2f55",
        "on_accent": "#0f1115", "pressed": "#232833", "disabled": "#5c636e", "disabled_bg": "#2a2f38",
        "error": "#ff7b72", "warning": "#f0b429", "ok": "#3fb950", "info": "#79c0ff",
        "banner": "#2a2313", "banner_border": "#5c4813",
        "plot_bg": "#171a21", "plot_fg": "#aab2bd", "series1": "#818cf8", "series2": "#3fb950", "series3": "#f0b429",
        "series4": "#e879f9", "series5": "#38bdf8", "series6": "#b9c0ca"}

_current = LIGHT


def is_dark() -> bool:
    app = QGuiApplication.instance()
    if app is None:
        return False
    scheme = app.styleHints().colorScheme()
    if scheme == Qt.ColorScheme.Dark:
        return True
    if scheme == Qt.ColorScheme.Light:
        return False
    return app.palette().color(QPalette.ColorRole.Window).lightness() < 128


def colors() -> dict[str, str]:
    return _current


def app_icon() -> QIcon:
    icon = QIcon(str(paths.ICON_PATH))
    if icon.isNull() or not icon.availableSizes():
        # No SVG image plugin: draw the icon through QtSvg ourselves.
        try:
            from PySide6.QtSvg import QSvgRenderer
            renderer = QSvgRenderer(str(paths.ICON_PATH))
            icon = QIcon()
            for size in (16, 24, 32, 48, 64, 128, 256):
                pm = QPixmap(size, size)
                pm.fill(Qt.GlobalColor.transparent)
                p = QPainter(pm)
                renderer.render(p)
                p.end()
                icon.addPixmap(pm)
        except ImportError:
            pass
    return icon


def _palette(c: dict[str, str]) -> QPalette:
    pal = QPalette()
    role = QPalette.ColorRole
    for r, key in ((role.Window, "window"), (role.WindowText, "text"), (role.Base, "input"),
                   (role.AlternateBase, "window"), (role.ToolTipBase, "surface"), (role.ToolTipText, "text"),
                   (role.Text, "text"), (role.Button, "surface"), (role.ButtonText, "text"),
                   (role.Highlight, "accent"), (role.HighlightedText, "on_accent"), (role.Link, "accent"),
                   (role.PlaceholderText, "muted")):
        pal.setColor(r, QColor(c[key]))
    for r in (role.WindowText, role.Text, role.ButtonText):
        pal.setColor(QPalette.ColorGroup.Disabled, r, QColor(c["disabled"]))
    return pal


def apply(app: QApplication, dark: bool | None = None) -> dict[str, str]:
    """Styles the whole application for the system's light or dark scheme (or the one asked)."""
    global _current
    _current = DARK if (is_dark() if dark is None else dark) else LIGHT
    app.setStyle("Fusion")
    app.setPalette(_palette(_current))
    try:
        qss = paths.STYLE_PATH.read_text(encoding="utf-8")
    except OSError:
        qss = ""
    for key, value in _current.items():
        qss = qss.replace(f"@{key}@", value)
    qss = qss.replace("@icons@", (paths.RESOURCES / "icons").as_posix())
    qss = qss.replace("@scheme@", "dark" if _current is DARK else "light")
    app.setStyleSheet(qss)
    return _current


def follow_system(app: QApplication, on_change=None):
    """Re-styles when the system switches between light and dark; returns the connected slot (to disconnect)."""
    def changed(scheme=None):
        known = {Qt.ColorScheme.Dark: True, Qt.ColorScheme.Light: False}
        apply(app, known.get(scheme))  # the scheme the signal carries; else ask the system again
        if on_change:
            on_change()
    app.styleHints().colorSchemeChanged.connect(changed)
    return changed
