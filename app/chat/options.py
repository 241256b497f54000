"""The chat's per-conversation settings: system prompt, temperature, top-p, top-k and max tokens. A value left at its
lowest entry follows the server's mode, and says what that is ("mode: 0.7"), so each field reads against the
defaults in force. The values are stored with the conversation (app/chat/store.py)."""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QDoubleSpinBox, QGridLayout, QLabel, QPlainTextEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from app.widgets import guard_wheel

# name -> (label, decimals or None for an integer, lowest real value, highest, step, tooltip)
FIELDS: dict[str, tuple[str, int | None, float, float, float, str]] = {
    "temperature": ("Temperature", 2, 0.0, 2.0, 0.05, "Higher is more varied, lower more predictable."),
    "top_p": ("Top-p", 2, 0.01, 1.0, 0.05, "Sample only from the most likely tokens that add up to this share."),
    "top_k": ("Top-k", None, 1, 1000, 1, "Sample only from this many most likely tokens."),
    "max_tokens": ("Max tokens", None, 1, 1_000_000, 64, "Longest answer in tokens."),
}


class ChatOptions(QWidget):
    changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 4)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt for this conversation (optional)")
        self.system_prompt.setMaximumHeight(70)
        layout.addWidget(self.system_prompt)
        grid = QGridLayout()
        grid.setHorizontalSpacing(8)
        self.spins: dict[str, QSpinBox | QDoubleSpinBox] = {}
        for i, (name, (label, decimals, lo, hi, step, tip)) in enumerate(FIELDS.items()):
            if decimals is None:
                spin = QSpinBox()
                spin.setRange(int(lo) - 1, int(hi))
            else:
                spin = QDoubleSpinBox()
                spin.setDecimals(decimals)
                spin.setRange(lo - 10 ** -decimals, hi)
            spin.setSingleStep(step)
            spin.setToolTip(tip + " At its lowest entry it follows the server's mode.")
            spin.setMinimumWidth(110)
            spin.setMaximumWidth(180)
            spin.valueChanged.connect(self.changed)
            text = QLabel(label)
            text.setObjectName("Muted")
            grid.addWidget(text, i // 2, (i % 2) * 2)
            grid.addWidget(spin, i // 2, (i % 2) * 2 + 1)
            self.spins[name] = spin
        grid.setColumnStretch(4, 1)
        reset = QPushButton("Use the mode's values")
        reset.setToolTip("Every field back to the server's mode")
        reset.clicked.connect(self.reset)
        grid.addWidget(reset, 0, 5)
        layout.addLayout(grid)
        self.system_prompt.textChanged.connect(self.changed)
        guard_wheel(self)
        self.set_defaults(None, None)

    def set_defaults(self, sampling: dict | None, max_tokens: int | None) -> None:
        """What the mode (or server) uses for each field left unset."""
        known = dict(sampling or {})
        known["max_tokens"] = max_tokens
        for name, spin in self.spins.items():
            value = known.get(name)
            shown = f"{value:g}" if isinstance(value, (int, float)) else None
            spin.setSpecialValueText(f"mode: {shown}" if shown and name != "max_tokens" else
                                     f"server: {shown}" if shown else "server default")

    def options(self) -> dict[str, Any]:
        """The fields set for this conversation (unset ones are left out)."""
        out: dict[str, Any] = {}
        for name, spin in self.spins.items():
            if spin.value() != spin.minimum():
                out[name] = round(spin.value(), 4) if isinstance(spin, QDoubleSpinBox) else int(spin.value())
        return out

    def set_options(self, options: dict[str, Any], system_prompt: str) -> None:
        self.blockSignals(True)
        for name, spin in self.spins.items():
            value = options.get(name)
            spin.setValue(value if isinstance(value, (int, float)) else spin.minimum())
        self.system_prompt.setPlainText(system_prompt)
        self.blockSignals(False)

    def set_value(self, name: str, value: Any) -> None:
        spin = self.spins[name]
        spin.setValue(value if isinstance(value, (int, float)) else spin.minimum())

    def reset(self) -> None:
        for spin in self.spins.values():
            spin.setValue(spin.minimum())
