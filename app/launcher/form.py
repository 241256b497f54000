"""The launcher's settings editor, generated from the one settings schema (engine/config/table.py).

Each setting's ``type``, ``choices``, ``minimum`` and ``maximum`` pick its widget; its ``help`` is the tooltip.
Numbers that also take ``auto`` or may be unset show that as the spin box's lowest entry. Fields are labelled in
words (app/launcher/wording.py), not flags; the wheel edits a field only while it has the focus. A value this version does
not support is marked in the choices; settings whose only supported value is the default are shown read-only (with
what would provide them), unless a preset set them, so the problem can be reset away. Each row has a reset button.
"""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel,
                               QLineEdit, QSpinBox, QToolButton, QVBoxLayout, QWidget)

from engine.config.table import Setting, show_value

from app.launcher.settings import FORM_SETTINGS, MAIN_SETTINGS, defaults
from app.widgets import guard_wheel
from app.launcher.wording import label as field_label

INT_MAX = 2**31 - 1
GROUP_TITLES = {"server": "Server", "model": "Model", "memory": "Memory", "speculative": "Speculative decoding",
                "sampling": "Sampling", "performance": "Performance"}


def tooltip(s: Setting) -> str:
    lines = [s.help, "", f"Flag: {s.flag}    Environment: {s.env}    TOML: {s.name}",
             f"Values: {s.values_text()}    Default: {show_value(s.default)}"
             + (f" ({s.default_means})" if s.default_means else "")]
    availability = s.availability()
    if availability != "yes":
        lines.append(f"This version: {availability}")
    return "\n".join(lines)


def only_default(s: Setting) -> bool:
    """The setting has no supported value but its default (a feature that comes later)."""
    if not s.needs:
        return False
    if s.choices or s.type is bool:
        candidates: list[Any] = list(s.choices or (False, True))
    else:
        candidates = list(dict.fromkeys([s.default] + (["auto"] if s.allow_auto else []) + ([0] if s.minimum == 0 else [])))
    return sum(1 for c in candidates if s.available(c)) <= 1


class SettingEditor(QWidget):
    """One setting's widget: ``value()`` gives a typed value (int, float, bool, str, list, "auto" or None)."""

    changed = Signal()

    def __init__(self, s: Setting, parent=None):
        super().__init__(parent)
        self.setting = s
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.special: Any = None  # what the spin box's lowest entry means ("auto" or None)
        if s.type is bool:
            w = self.widget = QCheckBox()
            w.toggled.connect(self.changed)
        elif s.choices:
            w = self.widget = QComboBox()
            for choice in s.choices:
                ok = s.available(choice)
                w.addItem(choice if ok else f"{choice}  (not in this version)", choice)
                if not ok:
                    w.setItemData(w.count() - 1, f"{choice}: not available in this version ({s.needs})",
                                  Qt.ItemDataRole.ToolTipRole)
            w.currentIndexChanged.connect(self.changed)
        elif s.type is int:
            w = self.widget = QSpinBox()
            lo = int(s.minimum) if s.minimum is not None else -INT_MAX
            hi = int(s.maximum) if s.maximum is not None else INT_MAX
            if s.allow_auto or s.nullable:
                self.special = "auto" if s.allow_auto else None
                lo -= 1
                w.setSpecialValueText("auto" if s.allow_auto else (s.default_means or "unset"))
            w.setRange(lo, hi)
            w.setAccelerated(True)
            if hi - lo > 10000:
                w.setSingleStep(64 if "kv" in s.name or "context" in s.name or "tokens" in s.name else 1)
            w.valueChanged.connect(self.changed)
        elif s.type is float:
            w = self.widget = QDoubleSpinBox()
            w.setDecimals(2)
            w.setSingleStep(0.05)
            lo = s.minimum if s.minimum is not None else -1e9
            hi = s.maximum if s.maximum is not None else 1e9
            if s.nullable:
                lo -= 0.01
                w.setSpecialValueText(s.default_means or "unset")
            w.setRange(lo, hi)
            w.valueChanged.connect(self.changed)
        else:  # str (text, path, secret) and list
            w = self.widget = QLineEdit()
            w.setPlaceholderText(s.default_means or ("unset" if s.nullable else ""))
            if s.secret:
                w.setEchoMode(QLineEdit.EchoMode.Password)
            w.textChanged.connect(self.changed)
        w.setToolTip(tooltip(s))
        w.setMinimumWidth(110)
        layout.addWidget(w, 1)
        self.reset = QToolButton()
        self.reset.setText("↺")
        self.reset.setToolTip(f"Reset {field_label(s.name)} to its default ({show_value(s.default)})")
        self.reset.clicked.connect(lambda: self.set_value(s.default))
        layout.addWidget(self.reset)
        self.changed.connect(self._update)
        self.fixed = only_default(s)
        self.set_value(s.default)

    def value(self) -> Any:
        s, w = self.setting, self.widget
        if isinstance(w, QCheckBox):
            return w.isChecked()
        if isinstance(w, QComboBox):
            return w.currentData()
        if isinstance(w, (QSpinBox, QDoubleSpinBox)):
            if (s.allow_auto or s.nullable) and w.value() == w.minimum():
                return self.special
            return w.value()
        text = w.text().strip()
        if s.type is list:
            return [p.strip() for p in text.split(",") if p.strip()]
        return text if text or not s.nullable else None

    def set_value(self, value: Any) -> None:
        w = self.widget
        if isinstance(w, QCheckBox):
            w.setChecked(bool(value) if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on"))
        elif isinstance(w, QComboBox):
            i = w.findData(str(value).lower() if value is not None else value)
            w.setCurrentIndex(max(i, 0))
        elif isinstance(w, (QSpinBox, QDoubleSpinBox)):
            if value is None or value == "auto":
                w.setValue(w.minimum())
            else:
                try:
                    w.setValue(int(value) if isinstance(w, QSpinBox) else float(value))
                except (TypeError, ValueError):
                    w.setValue(w.minimum())
        else:
            if isinstance(value, (list, tuple)):
                w.setText(", ".join(map(str, value)))
            else:
                w.setText("" if value is None else str(value))
        self._update()

    def _update(self) -> None:
        value = self.value()
        is_default = value == self.setting.default or (value in (None, [], "") and self.setting.default in (None, []))
        self.reset.setEnabled(not is_default)
        # a feature this version lacks: read-only while at its default (the reset fixes a preset's value)
        self.widget.setEnabled(not self.fixed or not is_default)


class SettingsForm(QWidget):
    """Every setting but the model, grouped; main settings always shown, the others with "Show all settings" (or
    whenever they differ from their default, so a preset's value is never hidden)."""

    changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.editors: dict[str, SettingEditor] = {}
        self.rows: dict[str, tuple[QLabel, SettingEditor, QFormLayout]] = {}
        self.groups: dict[str, QGroupBox] = {}
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.show_all = QCheckBox("Show all settings")
        self.show_all.setToolTip("Also show the settings most people never change, and those for features that "
                                 "come in later versions.")
        self.show_all.toggled.connect(self._update_visibility)
        layout.addWidget(self.show_all)
        for s in FORM_SETTINGS:
            box = self.groups.get(s.group)
            if box is None:
                box = self.groups[s.group] = QGroupBox(GROUP_TITLES.get(s.group, s.group.title()))
                form = QFormLayout(box)
                form.setLabelAlignment(Qt.AlignmentFlag.AlignRight)
                form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
                form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
                layout.addWidget(box)
            form = box.layout()
            editor = SettingEditor(s)
            label = QLabel(field_label(s.name) + (" (later)" if editor.fixed else ""))
            label.setToolTip(tooltip(s))
            if editor.fixed:
                label.setObjectName("Muted")
            form.addRow(label, editor)
            editor.changed.connect(self._changed)
            self.editors[s.name] = editor
            self.rows[s.name] = (label, editor, form)
        layout.addStretch(1)
        guard_wheel(self)
        self._update_visibility()

    def _changed(self) -> None:
        self._update_visibility()
        self.changed.emit()

    def _update_visibility(self) -> None:
        base = defaults()
        show_all = self.show_all.isChecked()
        for group, box in self.groups.items():
            any_shown = False
            for name, (label, editor, form) in self.rows.items():
                if editor.setting.group != group:
                    continue
                visible = show_all or name in MAIN_SETTINGS or editor.value() != base[name]
                form.setRowVisible(label, visible) if hasattr(form, "setRowVisible") else None
                any_shown |= visible
            box.setVisible(any_shown)

    def values(self) -> dict[str, Any]:
        return {name: e.value() for name, e in self.editors.items()}

    def set_values(self, values: dict[str, Any]) -> None:
        """Sets every editor (missing names get their default) and emits ``changed`` once."""
        base = defaults()
        for name, editor in self.editors.items():
            editor.blockSignals(True)
            editor.widget.blockSignals(True)
            editor.set_value(values.get(name, base[name]))
            editor.widget.blockSignals(False)
            editor.blockSignals(False)
        self._changed()

    def set_value(self, name: str, value: Any) -> None:
        self.editors[name].set_value(value)
