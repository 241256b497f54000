"""The launcher's validation panel: the memory ledger's bars and every check (errors first), each problem with its
remedy in the form's words (app/launcher/wording.py) and, where one value fixes it, a link that applies that value. It only
shows a ``Validation``; the checks themselves are computed Qt-free in app/launcher/validation.py."""
from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QVBoxLayout

from app import theme
from app.launcher.memory_bar import MemoryBar
from app.launcher.validation import Check, Validation
from app.launcher.wording import Fix, plain

ICONS = {"ok": "✔", "info": "ℹ", "warning": "⚠", "error": "✖"}
AREA_TITLES = {"hardware": "Hardware", "model": "Model", "memory": "Memory", "settings": "Settings",
               "environment": "Environment", "port": "Port", "load": "Loading"}
ORDER = {"error": 0, "warning": 1, "info": 2, "ok": 3}


def checks_html(checks: list[Check], fixes: list[Fix] | None = None) -> str:
    """The checks, errors first; each fix found is appended to ``fixes`` and linked as ``fix:INDEX``."""
    c = theme.colors()
    colours = {"ok": c["ok"], "info": c["info"], "warning": c["warning"], "error": c["error"]}
    fixes = [] if fixes is None else fixes
    parts = []
    for k in sorted(checks, key=lambda k: ORDER[k.level]):
        message, remedy_text, fix = plain(k.message, k.remedy)
        remedy = (f'<br><span style="color:{c["muted"]}">→ {html.escape(remedy_text)}</span>'
                  if remedy_text and k.level != "ok" else "")
        if fix is not None and k.level != "ok":
            fixes.append(fix)
            remedy += (f'<br><a href="fix:{len(fixes) - 1}" style="color:{c["accent"]};font-weight:600">'
                       f'[ {html.escape(fix.text)} ]</a>')
        parts.append(f'<table cellspacing="0" cellpadding="0" style="margin-bottom:8px"><tr>'
                     f'<td width="22" valign="top" style="color:{colours[k.level]};font-weight:600">'
                     f'{ICONS[k.level]}</td><td valign="top"><b>{AREA_TITLES.get(k.area, k.area)}:</b> '
                     f'{html.escape(message)}{remedy}</td></tr></table>')
    return "".join(parts)


class ChecksPanel(QFrame):
    fix_requested = Signal(object)  # a Fix: the user pressed its link

    def __init__(self, parent=None):
        super().__init__(parent)
        self.fixes: list[Fix] = []
        self.setObjectName("Card")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(14, 12, 14, 12)
        section = QLabel("Checks")
        section.setObjectName("Section")
        layout.addWidget(section)
        title = QLabel("Memory ledger")
        title.setObjectName("Muted")
        layout.addWidget(title)
        self.memory_bar = MemoryBar()
        layout.addWidget(self.memory_bar)
        self.checks_label = QLabel()
        self.checks_label.setWordWrap(True)
        self.checks_label.setTextFormat(Qt.TextFormat.RichText)
        self.checks_label.setAlignment(Qt.AlignmentFlag.AlignTop)
        self.checks_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                                  | Qt.TextInteractionFlag.LinksAccessibleByMouse)
        self.checks_label.linkActivated.connect(self._link)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(self.checks_label)
        layout.addWidget(scroll, 1)

    def show_validation(self, v: Validation, load_error: str | None = None) -> None:
        checks = list(v.checks)
        if load_error:
            checks.insert(0, Check("error", "load", load_error))
        fixes: list[Fix] = []
        self.checks_label.setText(checks_html(checks, fixes))
        self.fixes = fixes
        self.memory_bar.set_estimate(v.memory)

    def _link(self, href: str) -> None:
        kind, _, index = href.partition(":")
        if kind == "fix" and index.isdigit() and int(index) < len(self.fixes):
            self.fix_requested.emit(self.fixes[int(index)])
