"""The launcher's memory ledger as stacked bars: weights / draft / KV GPU / recurrent state (hybrids) / workspace /
headroom against VRAM, and host KV (with the runtime) against RAM; without a GPU one RAM bar holds everything. Each
bar starts with what other programs already use, so its end is the device's total memory; a red end and outline mean
the plan does not fit."""
from __future__ import annotations

import html
import re

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from app import theme
from app.launcher.estimate import MIB, Bar, MemoryEstimate

SEGMENT_COLORS = {"others": "disabled_bg", "weights": "series1", "draft": "series4", "kv": "series2",
                  "host_kv": "series5", "state": "info", "other": "series6", "headroom": "series3"}


def segment_color(key: str) -> str:
    return theme.colors()[SEGMENT_COLORS[key]]


class StackedBar(QWidget):
    """One device's bar."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.bar: Bar | None = None
        self.setMinimumHeight(20)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(300, 20)

    def set_bar(self, bar: Bar | None) -> None:
        self.bar = bar
        self.setToolTip(bar.text() if bar else "")
        self.update()

    def spans(self) -> list[tuple[str, float, float]]:
        """(segment key, start, width) as fractions of the bar; what does not fit is cut at the end."""
        b = self.bar
        if b is None or b.capacity <= 0:
            return []
        out, x = [], 0.0
        for key, size in [("others", b.others)] + [(s.key, s.bytes) for s in b.segments]:
            w = min(size / b.capacity, max(1.0 - x, 0.0))
            if w > 0:
                out.append((key, x, w))
            x += w
        return out

    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        c = theme.colors()
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        clip = QPainterPath()
        clip.addRoundedRect(rect, 5, 5)
        p.setClipPath(clip)
        p.fillRect(rect, QColor(c["input"]))
        for key, x, w in self.spans():
            part = QRectF(rect.left() + x * rect.width(), rect.top(), w * rect.width(), rect.height())
            color = QColor(segment_color(key))
            if key == "headroom":  # kept free, not allocated: hatched
                p.fillRect(part, QBrush(color, Qt.BrushStyle.BDiagPattern))
            else:
                p.fillRect(part, color)
        over = self.bar is not None and self.bar.over > 0
        if over:
            p.fillRect(QRectF(rect.right() - 6, rect.top(), 6, rect.height()), QColor(c["error"]))
        p.setClipping(False)
        p.setPen(QPen(QColor(c["error"] if over else c["border"]), 1.5 if over else 1))
        p.drawRoundedRect(rect, 5, 5)
        p.end()


class MemoryBar(QWidget):
    """Up to two bars (VRAM, RAM), each with a legend line in MiB."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.estimate: MemoryEstimate | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.rows: list[tuple[QLabel, StackedBar, QLabel]] = []
        for _ in range(2):
            title, bar, legend = QLabel(), StackedBar(), QLabel()
            title.setTextFormat(Qt.TextFormat.RichText)
            title.setWordWrap(True)  # "VRAM (GPU memory: ... free) ... over" must not widen the checks panel
            legend.setTextFormat(Qt.TextFormat.RichText)
            legend.setWordWrap(True)
            for w in (title, bar, legend):
                layout.addWidget(w)
            self.rows.append((title, bar, legend))
        self.footer = QLabel()
        self.footer.setObjectName("Muted")
        self.footer.setWordWrap(True)
        layout.addWidget(self.footer)
        self.set_estimate(None)

    def bars(self) -> list[Bar]:
        return self.estimate.bars() if self.estimate is not None else []

    def set_estimate(self, estimate: MemoryEstimate | None) -> None:
        self.estimate = estimate
        bars = self.bars()
        c = theme.colors()
        for i, (title, bar, legend) in enumerate(self.rows):
            b = bars[i] if i < len(bars) else None
            for w in (title, bar, legend):
                w.setVisible(b is not None)
            bar.set_bar(b)
            if b is None:
                continue
            where = "GPU memory" if b.device == "gpu" else "host memory"
            state = (f'<span style="color:{c["error"]};font-weight:600">&nbsp; {b.over / MIB:,.0f} MiB over</span>'
                     if b.over else "")
            title.setText(f"<b>{b.title}</b> <span style=\"color:{c['muted']}\">({where}: "
                          f"{b.budget / MIB:,.0f} of {b.capacity / MIB:,.0f} MiB free)</span>{state}")
            legend.setText(self.legend_html(b))
        if estimate is None:
            self.footer.setText("Shown once the model and the settings are valid.")
        else:
            self.footer.setText(f"KV: {estimate.kv_tokens:,} tokens × {estimate.kv_bytes_per_token:,} B "
                                f"({estimate.kv_dtype}); context {estimate.context:,}; weights "
                                f"{estimate.weight_format}. From the engine's memory ledger (ninfer-doctor --ledger).")

    @staticmethod
    def legend_html(bar: Bar) -> str:
        items = [(s.key, s.label, s.bytes) for s in bar.segments]
        if bar.others:
            items.append(("others", "other programs", bar.others))
        return " &nbsp; ".join(f'<span style="color:{segment_color(key)}">■</span>&nbsp;'
                               f'{label.replace(" ", "&nbsp;")}&nbsp;{size / MIB:,.0f}&nbsp;MiB'
                               for key, label, size in items)

    def legend_text(self) -> str:
        """The legends as plain text (what a user reads)."""
        return " | ".join(plain_text(legend.text()) for _, _, legend in self.rows if legend.isVisibleTo(self))



def plain_text(rich: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", rich)).replace("\xa0", " ")
