"""The first window: pick a model and a preset, adjust the settings, see every problem with its remedy, Start.

Checks run live (debounced) as anything changes. The slow parts run off the GUI thread: the hardware probe (imports
torch, asks NVML) once, and reading a model's header once per file. Start stays disabled while any check is an
error; a problem that one value fixes has a link that applies it. Picking a preset over the user's edits asks first.
Loading shows a progress bar and can be cancelled; once the weights are in, it says the engine is warming up.
"""
from __future__ import annotations

import asyncio
import html
import os
import time
from pathlib import Path
from typing import Any, Mapping

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QComboBox, QDialog, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QProgressBar,
                               QPushButton, QSizePolicy, QSplitter, QVBoxLayout, QWidget)

from app import theme
from app.asyncutil import spawn
from app.launcher.checks import ChecksPanel
from app.launcher.estimate import ModelInfo
from app.launcher.presets import PresetsMixin
from app.server.remote_dialog import RemoteDialog
from app.launcher.form import SettingsForm
from app.launcher.settings import Preset, baseline, changed_values, find_preset
from app.launcher.validation import Check, Validation, model_check, validate
from app.widgets import FormScrollArea, breakable, guard_wheel, remember_size, restore_size
from app.launcher.wording import EMBEDDED_NAME

EMBEDDED_LABEL = f"Embedded: {EMBEDDED_NAME} (Q4_1, runs anywhere)"
WARMUP_AT = 0.999  # loading progress from which the weights are in and the engine warms up


class LauncherWindow(PresetsMixin, QWidget):
    """``controller`` is the app's Controller (start_local, cancel_loading, connect_remote, config)."""

    validated = Signal()

    def __init__(self, controller, env: Mapping[str, str] | None = None):
        super().__init__()
        self.controller = controller
        self.config = controller.config
        self.env = os.environ if env is None else env
        self.report: Any = None  # engine.hardware.HardwareReport, once probed
        self.model_infos: dict[str | None, tuple[ModelInfo | None, Check | None]] = {}
        self._refused: set[str] = set()  # models whose check failed: out of the drop-down once another is picked
        self.validation: Validation | None = None
        self.loading = False
        self.load_error: str | None = None
        self.auto_start = False  # ninfer --start: start as soon as the checks pass
        self.notice = ""  # shown after the status until the next start (e.g. "loading cancelled")
        self.warmup_started: float | None = None  # when the weights were all in (the engine then warms up)
        self.preset_ref: str | None = None  # the preset the form is based on (to ask before replacing edits)
        # asks what to do with the user's edits when another preset is picked: "keep", "discard" or "cancel"
        self.ask_preset = self._ask_preset
        self.setObjectName("Launcher")
        self.setWindowTitle("NInfer — start a model")
        self.setWindowIcon(theme.app_icon())
        self.setMinimumSize(640, 480)
        self._timer = QTimer(self, singleShot=True, interval=150)
        self._timer.timeout.connect(self.revalidate)
        self._build()
        restore_size(self, self.config, "launcher", (1100, 760))
        self._restore()
        spawn(self._probe(), "hardware-probe")

    # ---- layout --------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        outer = QVBoxLayout(self)
        outer.setContentsMargins(18, 14, 18, 14)
        outer.setSpacing(10)

        head = QHBoxLayout()
        icon = QLabel()
        icon.setPixmap(theme.app_icon().pixmap(44, 44))
        head.addWidget(icon)
        titles = QVBoxLayout()
        title = QLabel("NInfer")
        title.setObjectName("Title")
        subtitle = QLabel("Run a model on this computer behind an OpenAI-compatible API.")
        subtitle.setObjectName("Subtitle")
        subtitle.setWordWrap(True)
        titles.addWidget(title)
        titles.addWidget(subtitle)
        head.addLayout(titles, 1)
        self.remote_button = QPushButton("Connect to a server…")
        self.remote_button.setToolTip("Chat with another OpenAI-compatible server instead of loading a model here.")
        self.remote_button.clicked.connect(self.connect_remote)
        head.addWidget(self.remote_button, 0, Qt.AlignmentFlag.AlignTop)
        outer.addLayout(head)

        self.banner = QLabel()
        self.banner.setObjectName("Banner")
        self.banner.setWordWrap(True)
        self.banner_button = QPushButton("Use the last configuration that worked")
        self.banner_button.clicked.connect(self.use_last_good)
        banner_row = QHBoxLayout()
        banner_row.addWidget(self.banner, 1)
        banner_row.addWidget(self.banner_button)
        self.banner_box = QWidget()
        self.banner_box.setLayout(banner_row)
        banner_row.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.banner_box)

        picks = QFormLayout()
        picks.setLabelAlignment(Qt.AlignmentFlag.AlignRight)
        model_row = QHBoxLayout()
        self.model_combo = QComboBox()
        self.model_combo.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        # a long model path must not widen the window
        self.model_combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_combo.setMinimumContentsLength(16)
        self.model_combo.setToolTip("The model to serve: the embedded default, a GGUF file or a Hugging Face folder "
                                    "(config.json + *.safetensors). Paths in any language work.")
        self.model_combo.currentIndexChanged.connect(self._model_changed)
        model_row.addWidget(self.model_combo, 1)
        gguf = self.gguf_button = QPushButton("GGUF file…")
        gguf.clicked.connect(self.browse_file)
        folder = QPushButton("HF folder…")
        folder.clicked.connect(self.browse_folder)
        library = QPushButton("Library…")
        library.setToolTip("Find, download and pick models: Hugging Face, LM Studio, Ollama, your folders.")
        library.clicked.connect(self.controller.show_library)
        model_row.addWidget(library)
        model_row.addWidget(gguf)
        model_row.addWidget(folder)
        picks.addRow("Model", model_row)
        preset_row = QHBoxLayout()
        self.preset_combo = QComboBox()
        self.preset_combo.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.preset_combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.preset_combo.setMinimumContentsLength(12)
        self.preset_combo.setToolTip("A preset fills the settings below; your changes go on top of it.")
        self.preset_combo.activated.connect(self._preset_picked)
        preset_row.addWidget(self.preset_combo, 1)
        save = QPushButton("Save as preset…")
        save.clicked.connect(self.save_preset)
        preset_row.addWidget(save)
        picks.addRow("Preset", preset_row)
        outer.addLayout(picks)

        split = QSplitter(Qt.Orientation.Horizontal)
        self.form = SettingsForm()
        self.form.changed.connect(self.schedule)
        split.addWidget(FormScrollArea(self.form, min_width=300))

        self.checks = ChecksPanel()
        self.memory_bar = self.checks.memory_bar
        self.checks_label = self.checks.checks_label
        self.checks.fix_requested.connect(self.apply_fix)
        split.addWidget(self.checks)
        split.setStretchFactor(0, 5)
        split.setStretchFactor(1, 4)
        split.setChildrenCollapsible(False)  # dragged to its end, a pane stops at its minimum width
        outer.addWidget(split, 1)

        bottom = QHBoxLayout()
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        self.progress.setVisible(False)
        self.status = QLabel()
        self.status.setObjectName("Muted")
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setVisible(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.start_button = QPushButton("Start")
        self.start_button.setObjectName("Primary")
        self.start_button.setEnabled(False)
        self.start_button.setDefault(True)
        self.start_button.clicked.connect(self.start)
        bottom.addWidget(self.status, 1)
        bottom.addWidget(self.progress, 2)
        bottom.addWidget(self.cancel_button)
        bottom.addWidget(self.start_button)
        outer.addLayout(bottom)
        self.status.setWordWrap(True)
        self.status.setMinimumWidth(120)
        guard_wheel(self.model_combo, self.preset_combo)

    # ---- state -------------------------------------------------------------------------------------------------------
    def _fill_models(self, select: str | None) -> None:
        self.model_combo.blockSignals(True)
        self.model_combo.clear()
        self.model_combo.addItem(EMBEDDED_LABEL, None)
        for path in self.config.recent_models:
            self.add_model_item(path)
        self.model_combo.blockSignals(False)
        self.select_model(select)

    def add_model_item(self, path: str) -> int:
        i = self.model_combo.findData(path)
        if i < 0:
            p = Path(path)
            self.model_combo.addItem(f"{path}  —  Hugging Face cache" if path.startswith("hf:") else
                                     f"{p.name}  —  {p.parent}", path)
            i = self.model_combo.count() - 1
            self.model_combo.setItemData(i, path, Qt.ItemDataRole.ToolTipRole)
        return i

    def select_model(self, path: str | None) -> None:
        i = 0 if not path else self.add_model_item(path)
        if self.model_combo.currentIndex() == i:
            self._model_changed()
        else:
            self.model_combo.setCurrentIndex(i)

    def _restore(self) -> None:
        last = self.config.last or {}
        self.apply_config(last)
        self._update_banner()

    def apply_config(self, cfg: Mapping[str, Any]) -> None:
        """Shows a launch configuration: model, preset and the values changed over the preset."""
        preset_ref = cfg.get("preset")
        self._fill_presets(preset_ref)
        values = baseline(self.preset)
        values.update(cfg.get("values") or {})
        self.form.set_values(values)
        self._fill_models(cfg.get("model"))
        self.schedule()

    @property
    def model(self) -> str | None:
        return self.model_combo.currentData()

    @property
    def preset(self) -> Preset | None:
        return find_preset(self.preset_combo.currentData())

    def launch_config(self) -> dict[str, Any]:
        from app.appconfig import launch_config
        return launch_config(self.model, self.preset.ref if self.preset else None,
                             changed_values(self.form.values(), self.preset))

    def _update_banner(self) -> None:
        good = self.config.last_good
        text = ""
        if self.load_error:
            text = f"<b>The model could not be loaded.</b> {html.escape(self.load_error)}"
        elif self.config.crashed:
            text = "<b>NInfer did not shut down properly last time</b> (it was killed, or it crashed)."
        elif self.config.last_failure:
            text = f"<b>The last start failed:</b> {html.escape(self.config.last_failure)}"
        self.banner.setText(text)
        self.banner_button.setVisible(bool(good) and good != self.launch_config())
        self.banner_box.setVisible(bool(text))

    def use_last_good(self) -> None:
        if self.config.last_good:
            self.load_error = None
            self.config.acknowledge_crash()
            self.apply_config(self.config.last_good)
            self._update_banner()

    # ---- reacting --------------------------------------------------------------------------------------------------
    def _model_changed(self, *_args) -> None:
        model = self.model
        self._drop_refused(keep=model)
        if model not in self.model_infos:
            spawn(self._read_model(model), "read-model")
        self.schedule()

    def _drop_refused(self, keep: str | None) -> None:
        for path in [p for p in self._refused if p != keep]:
            i = self.model_combo.findData(path)
            if i >= 0:
                self.model_combo.blockSignals(True)
                self.model_combo.removeItem(i)
                self.model_combo.blockSignals(False)
            self._refused.discard(path)

    def schedule(self) -> None:
        self._timer.start()

    async def _probe(self) -> None:
        from engine.hardware import probe
        self.report = await asyncio.to_thread(probe)
        self.schedule()

    async def _read_model(self, model: str | None) -> None:
        info, problem = self.model_infos[model] = await asyncio.to_thread(model_check, model)
        if problem is not None and model and model in self.config.recent_models and Path(model).exists():
            self.config.forget_model(model)  # a broken file does not come back in the list at the next start
            self._refused.add(model)  # nor in the drop-down, once another model is picked
            self.model_infos[model] = (None, Check(problem.level, problem.area, problem.message,
                                                   problem.remedy + " It was taken off the recent models."))
        self.schedule()

    def revalidate(self) -> Validation:
        model = self.model
        info, problem = self.model_infos.get(model, (None, None))
        v = self.validation = validate(self.form.values(), model, self.preset, self.report, self.env, info=info,
                                       read_model=False, model_error=problem, check_port=not self.loading)
        self._show(v)
        ready = v.ok and self.report is not None and info is not None
        self.start_button.setEnabled(ready and not self.loading)
        if not self.loading:
            n_err, n_warn = len(v.errors), sum(1 for c in v.checks if c.level == "warning")
            if self.report is None or (info is None and problem is None):
                self.status.setText("Checking…")
            elif n_err:
                self.status.setText(f"{n_err} problem{'s' if n_err > 1 else ''} to fix before starting")
            else:
                self.status.setText("Ready to start" + (f" ({n_warn} warning{'s' if n_warn > 1 else ''})"
                                                        if n_warn else ""))
            if self.notice:
                self.status.setText(f"{self.notice} · {self.status.text()}")
        self._update_banner()
        self.validated.emit()
        checked = self.report is not None and (info is not None or problem is not None)
        if self.auto_start and checked and not self.loading:
            self.auto_start = False  # once: with a problem, the user fixes it and presses Start
            if ready:
                self.start()
        return v

    def _show(self, v: Validation) -> None:
        self.checks.show_validation(v, self.load_error)

    def hideEvent(self, event) -> None:
        remember_size(self, self.config, "launcher")
        super().hideEvent(event)

    def closeEvent(self, event) -> None:
        remember_size(self, self.config, "launcher")
        handler = getattr(self.controller, "launcher_closing", None)
        if handler is None:
            event.accept()
        else:
            handler(event)

    # ---- actions -----------------------------------------------------------------------------------------------------
    def browse_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model file", self._browse_dir(),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.pick_model(path)

    def browse_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder", self._browse_dir())
        if path:
            self.pick_model(path)

    def _browse_dir(self) -> str:
        model = self.model
        return str(Path(model).parent) if model else str(Path.home())

    def pick_model(self, path: str) -> None:
        self.config.add_recent_model(path)
        self.select_model(path)

    def start(self) -> None:
        v = self.revalidate()
        if not v.ok or v.settings is None or self.loading:
            return
        self.load_error = None
        self.notice = ""
        config = self.launch_config()
        try:
            self.controller.start_local(v.settings, config)
        except Exception as e:  # port taken between the check and now, model vanished, ...
            self.loading_finished(False, str(e))
            return
        self.set_loading(True)

    def set_loading(self, loading: bool) -> None:
        self.loading = loading
        self.progress.setVisible(loading)
        self.cancel_button.setVisible(loading)
        self.cancel_button.setEnabled(True)
        self.form.setEnabled(not loading)
        self.model_combo.setEnabled(not loading)
        self.preset_combo.setEnabled(not loading)
        self.remote_button.setEnabled(not loading)
        self.start_button.setEnabled(False)
        self.warmup_started = None
        self.progress.setRange(0, 1000)
        if loading:
            self.progress.setValue(0)
            self.status.setText("Starting…")
        else:
            self.schedule()

    def loading_progress(self, fraction: float, message: str) -> None:
        if fraction < WARMUP_AT:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))
            note = f"  ({breakable(message)})" if message else ""  # a long tensor name wraps, never cut off
            self.status.setText(f"Loading the weights… {fraction:.0%}{note}")
            return
        # the weights are in; the engine builds its KV pools, warms up and compiles before it answers
        if self.warmup_started is None:
            self.warmup_started = time.monotonic()
        self.progress.setRange(0, 0)  # busy: the engine reports no fraction for this part
        seconds = time.monotonic() - self.warmup_started
        phase = message.removeprefix("warm-up: ") if message.startswith("warm-up: ") else \
            "building the KV cache pools and compiling"  # (the engine's phases: engine/build.py's WARMUP messages)
        self.status.setText(f"Weights loaded. Warming up: {phase}… {seconds:.0f} s")

    def loading_finished(self, ok: bool, error: str = "") -> None:
        self.set_loading(False)
        if not ok:
            self.load_error = error or "the model could not be loaded"
            self.status.setText("Not started")
        self.revalidate()

    def cancel(self) -> None:
        self.cancel_button.setEnabled(False)
        self.status.setText("Cancelling…")
        self.controller.cancel_loading()

    def connect_remote(self) -> None:
        last = self.config.get("remote", {}) or {}
        dialog = RemoteDialog(self, last.get("url", ""), "")
        if dialog.exec() == QDialog.DialogCode.Accepted:
            spawn(self._connect(dialog.url.text().strip(), dialog.key.text().strip() or None), "connect-remote")

    async def _connect(self, url: str, key: str | None) -> None:
        self.status.setText(f"Connecting to {url}…")
        error = await self.controller.connect_remote(url, key)
        self.status.setText(f"Could not connect: {error}" if error else "")
