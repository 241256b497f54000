"""The model library's "On this computer" tab (Qt): the GGUF models in the Hugging Face cache, LM Studio's and
Ollama's stores and the folders the user added, with architecture, parameters, quant, context, size, last use and the
memory ledger's fit mark for this machine (app/library/marks.py, its numbers in the tooltip); the model the server
runs now is badged "loaded". Load one, or Remove a download of ours. The scan and the marks read headers only and
run on a worker thread."""
from __future__ import annotations

import asyncio
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QFileDialog, QHBoxLayout, QLabel, QMessageBox, QPushButton,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from engine.library.fit import FitMark
from engine.library.hub import LibraryError
from engine.library.local import LocalModel
from engine.service import READY

from app import theme
from app.asyncutil import spawn
from app.library import marks
from app.library.rows import MARK_COLOURS, context_text, last_used_text, params_text, size_text
from app.widgets import NamedRowsTable

COLUMNS = ("Model", "From", "Architecture", "Parameters", "Quant", "Context", "Size", "Last used",
           "Fit on this computer")
FIT_COLUMN = COLUMNS.index("Fit on this computer")
FOLDERS_KEY = "library_folders"
LOADED = "  ● loaded"  # after the name of the model the server runs now


class LocalPanel(QWidget):
    def __init__(self, controller):
        super().__init__()
        self.controller = controller
        self.models: list[LocalModel] = []
        self.scans = 0  # finished scans (tests wait on it)
        self.marked = 0  # scans whose every model has its fit mark
        self.marks: dict[str, FitMark] = {}  # model name -> its mark
        self.loaded_row: int | None = None  # the row badged "loaded"
        self._loaded_key: tuple | None = None  # (the served file, the scan) the badge was last placed for
        self.loading: LocalModel | None = None  # the model Load asked for, until it serves (or failed)
        self.after_scan = ""  # what the status line says after the next scan's count
        controller.state_changed.connect(self._follow_load)
        controller.state_changed.connect(self._show_loaded)
        # asks before deleting a download from disk; replaced in tests
        self.confirm_remove = self._confirm_remove
        outer = QVBoxLayout(self)
        self.table = NamedRowsTable(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(False)  # (a wrapped name is cut at its line's end whatever the elide mode)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # a cut name keeps its quant and "● loaded"
        self.table.itemSelectionChanged.connect(self._picked)
        self.table.doubleClicked.connect(lambda *_: self.load())
        outer.addWidget(self.table, 1)
        row = QHBoxLayout()
        self.status = QLabel()
        self.status.setObjectName("Muted")
        self.status.setWordWrap(True)
        self.add_button = QPushButton("Add folder…")
        self.add_button.clicked.connect(lambda: self.add_folder())  # clicked's `checked` is no folder
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.remove_button = QPushButton("Remove…")
        self.remove_button.clicked.connect(self.remove)
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("Primary")
        self.load_button.clicked.connect(self.load)
        row.addWidget(self.status, 1)
        for b in (self.add_button, self.refresh_button, self.remove_button, self.load_button):
            row.addWidget(b)
        outer.addLayout(row)
        self._picked()

    def folders(self) -> list[str]:
        return [f for f in (self.controller.config.get(FOLDERS_KEY) or []) if isinstance(f, str)]

    def add_folder(self, folder: str | None = None) -> None:
        if folder is None:
            folder = QFileDialog.getExistingDirectory(self, "Add a folder of GGUF models", str(Path.home()))
        if folder:
            self.controller.config.set(FOLDERS_KEY, [folder] + [f for f in self.folders() if f != folder])
            self.refresh()

    def refresh(self) -> None:
        spawn(self._scan(), "library-scan")

    async def _scan(self) -> None:
        from engine.library.local import scan

        self.status.setText("Looking for models…")
        folders = [Path(f) for f in self.folders()]
        models = await asyncio.to_thread(lambda: [(m, m.last_used) for m in scan(folders, embedded=True)])
        models.sort(key=lambda mw: -(mw[1] or 0))  # the most recently used first
        self.models = [m for m, _ in models]
        self.table.setRowCount(len(models))
        self.loaded_row = None
        for i, (m, used) in enumerate(models):
            cells = (m.name, m.source, m.architecture or "?", params_text(m.parameters), m.quant or "?",
                     context_text(m.context_length), size_text(m.size), last_used_text(used), "checking…")
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(str(m.path))
                if not m.supported:
                    item.setForeground(QColor(theme.colors()["muted"]))
                    item.setToolTip(m.problem or f"This engine cannot run the {m.architecture or 'unknown'} "
                                                 f"architecture.")
                self.table.setItem(i, c, item)
        self.scans += 1
        count = (f"{len(models)} model{'s' if len(models) != 1 else ''} on this computer." if models else
                 "No GGUF models found yet: download one in the Find tab, or add a folder.")
        self.status.setText(f"{self.after_scan} {count}" if self.after_scan else count)
        self.after_scan = ""
        self._show_loaded()
        self._picked()
        await self._mark(self.scans)

    async def _mark(self, scan: int) -> None:
        """Each model's fit mark, one at a time on a worker thread (a newer scan takes over)."""
        from engine.library.fit import machine_memory

        vram, ram = await asyncio.to_thread(machine_memory)
        settings = self._settings()
        where = marks.memory_text(vram, ram)
        for i, m in enumerate(list(self.models)):
            mark = await asyncio.to_thread(marks.mark_local, m, vram_mib=vram, ram_mib=ram, settings=settings)
            if scan != self.scans:
                return
            self.marks[m.name] = mark
            item = QTableWidgetItem(mark.mark)
            item.setToolTip(f"{mark}\n\n(planned by the memory ledger {where})")
            item.setForeground(QColor(theme.colors()[MARK_COLOURS.get(mark.mark, "muted")]))
            self.table.setItem(i, FIT_COLUMN, item)
        self.marked = scan

    def _settings(self) -> dict:
        launcher = getattr(self.controller, "launcher", None)
        return launcher.form.values() if launcher is not None else {}

    def loaded_path(self) -> Path | None:
        """The model file the embedded server runs now (None: none, or chatting with another server)."""
        c = self.controller
        s = c.service
        if c.remote or s is None or s.status != READY or c.switching:
            return None
        return Path(s.model_path) if s.model_path else None

    def _show_loaded(self) -> None:
        """Badges the row of the model the server runs now ("● loaded" after its name, in bold)."""
        path = self.loaded_path()
        if (path, self.scans) == self._loaded_key:
            return  # (asked every second, with the status)
        self._loaded_key = (path, self.scans)
        row = next((i for i, m in enumerate(self.models) if marks.same_file(m, path)), None) if path else None
        if row == self.loaded_row:
            return
        for i, badge in ((self.loaded_row, False), (row, True)):
            item = self.table.item(i, 0) if i is not None and i < len(self.models) else None
            if item is None:
                continue
            item.setText(self.models[i].name + (LOADED if badge else ""))
            font = item.font()
            font.setBold(badge)
            item.setFont(font)
            item.setToolTip(f"The server runs this model now.\n{self.models[i].path}" if badge else
                            str(self.models[i].path))
        self.loaded_row = row

    def selected(self) -> LocalModel | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        return self.models[rows[0].row()] if rows and rows[0].row() < len(self.models) else None

    def select(self, name: str) -> None:
        for i, m in enumerate(self.models):
            if m.name == name:
                self.table.selectRow(i)

    def _picked(self) -> None:
        m = self.selected()
        self.load_button.setEnabled(m is not None and m.supported)
        self.remove_button.setEnabled(m is not None)

    def load(self) -> None:
        m = self.selected()
        if m is None or not m.supported:
            return
        error = self.controller.load_model(m.model_arg)
        self.status.setText(error or f"Loading {m.name}…")
        self.loading = None if error else m

    def _follow_load(self) -> None:
        """The status line follows the load Load started (its percentage, then that it serves, or why not), and the
        list is read again once it serves (its "Last used")."""
        m, c = self.loading, self.controller
        if m is None:
            return
        s = c.service
        if c.switching or c.starting or (s is not None and s.status == "loading"):
            progress = f" {s.progress:.0%}" if s is not None and s.status == "loading" else ""
            self.status.setText(f"Loading {m.name}…{progress}")
            return
        self.loading = None
        if s is not None and s.status == READY:
            error = getattr(s, "switch_error", None)
            self.after_scan = f"Could not load {m.name}: {error}" if error else f"{m.name} is loaded and serving."
            self.refresh()
        elif s is not None:
            self.status.setText(f"Loading {m.name} failed: {s.load_error or s.status}")

    def _confirm_remove(self, m: LocalModel) -> bool:
        answer = QMessageBox.question(self, "Remove the model?", f"Delete {m.name} ({size_text(m.size)}) from disk?")
        return answer == QMessageBox.StandardButton.Yes

    def remove(self) -> None:
        m = self.selected()
        if m is None:
            return
        from engine.library.local import HF, remove

        if m.source == HF and not self.confirm_remove(m):
            return
        try:
            freed = remove(m)
        except LibraryError as e:
            self.status.setText(str(e))
            return
        self.status.setText(f"Removed {m.name}: {size_text(freed)} freed.")
        self.refresh()
