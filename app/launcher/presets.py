"""The launcher's presets, as a part of LauncherWindow: the preset list, picking a preset (asking first when the
user has changed settings over the current one), saving the form as the user's preset, and applying a check's fix."""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QInputDialog, QMessageBox

from app.launcher.settings import Preset, baseline, changed_values, find_preset, presets, save_user_preset
from app.launcher.wording import Fix, label as field_label


class PresetsMixin:
    """Expects LauncherWindow's preset_combo, form, preset, preset_ref, ask_preset and schedule()."""

    def _fill_presets(self, select: str | None) -> None:
        self.preset_combo.clear()
        self.preset_combo.addItem("(none: defaults)", None)
        for p in presets():
            self.preset_combo.addItem(p.label, p.ref)
            self.preset_combo.setItemData(self.preset_combo.count() - 1, str(p.path), Qt.ItemDataRole.ToolTipRole)
        i = self.preset_combo.findData(select) if select else 0
        self.preset_combo.setCurrentIndex(max(i, 0))
        self.preset_ref = self.preset_combo.currentData()

    def _preset_picked(self, *_args) -> None:
        new = self.preset
        old = find_preset(self.preset_ref)
        edits = changed_values(self.form.values(), old)
        if new == old and not edits:
            return
        choice = self.ask_preset(edits, new) if edits else "discard"
        if choice == "cancel":
            i = self.preset_combo.findData(self.preset_ref) if self.preset_ref else 0
            self.preset_combo.setCurrentIndex(max(i, 0))
            return
        values = baseline(new)
        if choice == "keep":
            values.update(edits)
        self.preset_ref = self.preset_combo.currentData()
        self.form.set_values(values)
        self.schedule()

    def _ask_preset(self, edits: dict[str, Any], preset: Preset | None) -> str:
        names = ", ".join(field_label(k) for k in list(edits)[:4]) + (" …" if len(edits) > 4 else "")
        box = QMessageBox(QMessageBox.Icon.Question, "Apply the preset?",
                          f"You changed {len(edits)} setting{'s' if len(edits) > 1 else ''} ({names}). "
                          f"Apply “{preset.label if preset else 'defaults'}” and keep your changes on top, or "
                          f"replace them with the preset's values?", parent=self)
        keep = box.addButton("Keep my changes", QMessageBox.ButtonRole.AcceptRole)
        discard = box.addButton("Use the preset's values", QMessageBox.ButtonRole.DestructiveRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(keep)
        box.exec()
        return "keep" if box.clickedButton() is keep else "discard" if box.clickedButton() is discard else "cancel"

    def apply_fix(self, fix: Fix) -> None:
        """A check's fix link: sets the one value it names (the checks run again)."""
        if fix.name in self.form.editors:
            self.form.set_value(fix.name, fix.value)
            self.schedule()

    def save_preset(self) -> None:
        name, ok = QInputDialog.getText(self, "Save as preset", "Name of the new preset:")
        if not ok or not name.strip():
            return
        try:
            preset = save_user_preset(name, self.form.values())
        except (ValueError, OSError) as e:
            QMessageBox.warning(self, "Save as preset", str(e))
            return
        self._fill_presets(preset.ref)
        self.schedule()
