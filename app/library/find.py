"""The model library's Find tab (Qt): search the hub for GGUF repositories, list a repository's files with the memory
ledger's mark for this machine and the launcher's settings, download one with progress (bytes, rate, time left) and
cancel, then load it. Hub calls and downloads run on worker threads; the download thread signals its progress and
the bar is redrawn at most five times a second."""
from __future__ import annotations

import asyncio
import html
import threading
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QProgressBar, QPushButton, QSplitter, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget)

from engine.library.download import DownloadCancelled, DownloadProgress
from engine.library.fit import FitMark
from engine.library.hub import HubFile, LibraryError
from engine.library.split import base_name

from app import theme
from app.asyncutil import spawn
from app.library.rows import MARK_COLOURS, hub_reference, params_text, progress_text, size_text

REDRAW_MS = 200
COLUMNS = ("File", "Quant", "Size", "Fit on this computer")


def _files(n: int) -> str:
    return f"{n} GGUF file{'s' if n != 1 else ''}"


class FindPanel(QWidget):
    progress_signal = Signal(object)  # DownloadProgress, emitted on the download thread
    downloaded = Signal(str)  # the local path of a finished download

    def __init__(self, controller):
        super().__init__()
        self.controller = controller
        self.hub_files: list[HubFile] = []
        self.marks: dict[str, FitMark] = {}
        self.paths: dict[str, Path] = {}  # filename -> local path of what this panel downloaded
        self.repo_id: str | None = None
        self.memory: tuple[int, int] | None = None
        self.downloading: HubFile | None = None
        self.progress_shown = 0  # progress redraws so far (the bar is throttled)
        self._latest: DownloadProgress | None = None
        self._cancel: threading.Event | None = None
        self._build()
        self.progress_signal.connect(self._progress_arrived)
        self._timer = QTimer(self, interval=REDRAW_MS)
        self._timer.timeout.connect(self._redraw_progress)

    def _build(self) -> None:
        outer = QVBoxLayout(self)
        row = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search Hugging Face for GGUF models, e.g. qwen3 or llama 3.2")
        self.query.returnPressed.connect(self.search)
        self.search_button = QPushButton("Search")
        self.search_button.clicked.connect(self.search)
        row.addWidget(self.query, 1)
        row.addWidget(self.search_button)
        outer.addLayout(row)
        split = QSplitter(Qt.Orientation.Horizontal)
        self.repos = QListWidget()
        self.repos.currentItemChanged.connect(self._repo_picked)
        split.addWidget(self.repos)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        self.files = QTableWidget(0, len(COLUMNS))
        self.files.setHorizontalHeaderLabels(COLUMNS)
        self.files.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.files.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.files.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.files.verticalHeader().setVisible(False)
        header = self.files.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for c in (1, 2, 3):
            header.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        self.files.itemSelectionChanged.connect(self._file_picked)
        rl.addWidget(self.files, 1)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        rl.addWidget(self.detail)
        split.addWidget(right)
        split.setStretchFactor(1, 2)
        split.setSizes([300, 600])
        outer.addWidget(split, 1)
        bottom = QHBoxLayout()
        self.status = QLabel()
        self.status.setObjectName("Muted")
        self.status.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        self.progress.setVisible(False)
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.setVisible(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.download_button = QPushButton("Download")
        self.download_button.setEnabled(False)
        self.download_button.clicked.connect(self.download)
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("Primary")
        self.load_button.setEnabled(False)
        self.load_button.clicked.connect(self.load)
        bottom.addWidget(self.status, 2)
        bottom.addWidget(self.progress, 1)
        bottom.addWidget(self.cancel_button)
        bottom.addWidget(self.download_button)
        bottom.addWidget(self.load_button)
        outer.addLayout(bottom)

    # ---- search and marks -----------------------------------------------------------------------------------------
    def search(self) -> None:
        spawn(self._search(self.query.text().strip()), "library-search")

    async def _search(self, query: str) -> None:
        from engine.library.hub import search

        self.status.setText(f"Searching for {query!r}…")
        self.search_button.setEnabled(False)
        try:
            results = await asyncio.to_thread(search, query)
        except LibraryError as e:
            self.status.setText(str(e))
            return
        finally:
            self.search_button.setEnabled(True)
        self.repos.clear()
        for r in results:
            facts = " · ".join(x for x in (r.architecture, params_text(r.parameters) if r.parameters else "",
                                           f"{r.downloads:,} downloads", "gated" if r.gated else "") if x)
            item = QListWidgetItem(f"{r.repo_id}\n{facts}")
            item.setData(Qt.ItemDataRole.UserRole, r.repo_id)
            self.repos.addItem(item)
        self.status.setText(f"{len(results)} repositor{'ies' if len(results) != 1 else 'y'}" if results else f"Nothing found for {query!r}.")

    def _repo_picked(self, item: QListWidgetItem | None, _previous=None) -> None:
        if item is not None:
            spawn(self._list_files(item.data(Qt.ItemDataRole.UserRole)), "library-files")

    def _settings(self) -> dict:
        launcher = getattr(self.controller, "launcher", None)
        return launcher.form.values() if launcher is not None else {}

    async def _list_files(self, repo_id: str) -> None:
        from engine.library.fit import machine_memory, mark_hub_file
        from engine.library.hub import list_files

        self.repo_id, self.hub_files, self.marks = repo_id, [], {}
        self.files.setRowCount(0)
        self.status.setText(f"Listing the files of {repo_id}…")
        try:
            files = await asyncio.to_thread(list_files, repo_id)
            if self.memory is None:
                self.memory = await asyncio.to_thread(machine_memory)
        except LibraryError as e:
            self.status.setText(str(e))
            return
        if self.repo_id != repo_id:
            return  # another repository was picked meanwhile
        self.hub_files = files
        self.files.setRowCount(len(files))
        for i, f in enumerate(files):
            name = f"{base_name(f.filename)} ({len(f.parts)} parts)" if f.parts else f.filename
            for c, text in enumerate((name, f.quant or "?", size_text(f.size), "checking…")):
                self.files.setItem(i, c, QTableWidgetItem(text))
        self.status.setText(f"{_files(len(files))} in {repo_id}; reading each header to check the fit…")
        vram, ram = self.memory
        settings = self._settings()
        for i, f in enumerate(files):
            mark = await asyncio.to_thread(mark_hub_file, f, vram_mib=vram, ram_mib=ram, settings=settings)
            if self.repo_id != repo_id:
                return
            self.marks[f.filename] = mark
            item = QTableWidgetItem(mark.mark)
            item.setToolTip(str(mark))
            colour = MARK_COLOURS.get(mark.mark, "muted")
            item.setForeground(QColor(theme.colors()[colour]))
            self.files.setItem(i, 3, item)
        where = f"{vram:,} MiB VRAM free" if vram else "no GPU"
        self.status.setText(f"{_files(len(files))} in {repo_id}; marks for {where} and {ram:,} MiB RAM available, "
                            f"with the launcher's settings.")
        self._file_picked()

    def selected_file(self) -> HubFile | None:
        rows = self.files.selectionModel().selectedRows() if self.files.selectionModel() else []
        return self.hub_files[rows[0].row()] if rows and rows[0].row() < len(self.hub_files) else None

    def select_file(self, filename: str) -> None:
        for i, f in enumerate(self.hub_files):
            if f.filename == filename:
                self.files.selectRow(i)

    def _file_picked(self) -> None:
        f = self.selected_file()
        mark = self.marks.get(f.filename) if f is not None else None
        self.detail.setText(f"<b>{html.escape(mark.mark)}</b> {html.escape(mark.detail)}" if mark else "")
        busy = self.downloading is not None
        self.download_button.setEnabled(f is not None and not busy)
        self.load_button.setEnabled(f is not None and f.filename in self.paths and not busy)

    # ---- download --------------------------------------------------------------------------------------------------
    def download(self) -> None:
        f = self.selected_file()
        if f is None or self.downloading is not None:
            return
        self.downloading, self._cancel, self._latest = f, threading.Event(), None
        self.progress.setValue(0)
        self.progress.setVisible(True)
        self.cancel_button.setVisible(True)
        self.cancel_button.setEnabled(True)
        self.status.setText(f"Downloading {f.filename}…")
        self._file_picked()
        self._timer.start()
        spawn(self._download(f, self._cancel), "library-download")

    async def _download(self, f: HubFile, cancel: threading.Event) -> None:
        from engine.library.download import download

        path, error = None, ""
        try:
            path = await asyncio.to_thread(download, f, on_progress=self.progress_signal.emit, cancel=cancel)
        except DownloadCancelled:
            error = f"Download of {f.filename} cancelled; Download again continues where it stopped."
        except LibraryError as e:
            error = str(e)
        self._timer.stop()
        self._redraw_progress()  # the last report
        self.downloading = None
        self.progress.setVisible(False)
        self.cancel_button.setVisible(False)
        if path is not None:
            self.paths[f.filename] = path
            self.status.setText(f"Downloaded {f.filename} ({size_text(f.size)}), verified: press Load to use it.")
            self.downloaded.emit(str(path))
        else:
            self.status.setText(error)
        self._file_picked()

    def _progress_arrived(self, p: DownloadProgress) -> None:
        self._latest = p  # drawn by the timer: a fast download sends many more reports than the eye needs

    def _redraw_progress(self) -> None:
        p = self._latest
        if p is None or self.downloading is None:
            return
        self._latest = None
        self.progress_shown += 1
        self.progress.setValue(int(p.fraction * 1000))
        self.status.setText(f"Downloading {self.downloading.filename}: {progress_text(p)}")

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
            self.cancel_button.setEnabled(False)
            self.status.setText("Cancelling…")

    def load(self) -> None:
        f = self.selected_file()
        if f is None or f.filename not in self.paths:
            return
        same = sum(1 for g in self.hub_files if g.quant == f.quant and (g.parts or g.split is None))
        model = hub_reference(f.repo_id, f.quant, same) or str(self.paths[f.filename])
        error = self.controller.load_model(model)
        self.status.setText(error or f"Loading {model}…")
