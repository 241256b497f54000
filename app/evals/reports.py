"""The evaluation reports panel: the ``ninfer-eval`` reports in a folder (newest first), the chosen one shown as its
tables and heatmap, the last report of the configuration the launcher has chosen, and a Run button that starts a
check on that configuration (``python -m engine.tools.eval CHECK FLAGS --json REPORT``) and shows it when done.

A report is the JSON that ``ninfer-eval CHECK --json FILE`` writes (its command, check, engine flags and summary), or
a ``compare`` folder's report.json with its report.md. The default folder is the app's data folder's ``eval``."""
from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QProcess, Qt, QUrl, Signal
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QLineEdit, QListWidget, QListWidgetItem,
                               QPlainTextEdit, QPushButton, QSplitter, QTextBrowser, QVBoxLayout, QWidget)

CHECKS = ("needle", "count", "kld", "code", "agent")


def configuration_flags(settings) -> list[str]:
    """The ninfer-serve flags that give `settings`' model and engine settings where they differ from the defaults
    (server and sampling settings do not change what a check measures): how the panel names a configuration."""
    from engine.config.table import SETTINGS

    flags: list[str] = []
    for s in SETTINGS:
        if s.group == "sampling" or (s.group == "server" and s.name != "model"):
            continue
        value = getattr(settings, s.name)
        if value == s.default:
            continue
        if s.type is bool:
            flags.append(s.flag if value else "--no-" + s.flag[2:])
        elif s.type is list:
            flags += [part for v in value for part in (s.flag, str(v))]
        else:
            flags += [s.flag, str(value)]
    return flags


def reports_dir() -> Path:
    from app.paths import data_dir

    path = data_dir() / "eval"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Report:
    path: Path
    check: str
    flags: list[str]
    headline: str
    data: dict

    def markdown(self) -> str:
        if "checks" in self.data:  # a compare report: its own Markdown sits next to it
            md = self.path.with_name("report.md")
            return md.read_text(encoding="utf-8") if md.is_file() else json.dumps(self.data, indent=2)
        text = self.data.get("table")  # written by ninfer-eval --json beside the numbers
        if not isinstance(text, str):
            return "```\n" + json.dumps(self.data, indent=2) + "\n```"
        head, _, table = text.partition("\n\n")
        return "```\n" + head + "\n```\n\n" + table + (f"\n\n![heatmap]({self.data['png']})"
                                                       if self.data.get("png") else "")


def read_report(path: Path) -> Report | None:
    """The report in ``path``, or None when it is not one (other JSON, a file cut short)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if "checks" in data and "a" in data and "b" in data:
        return Report(path, "compare", [], f"compare: {', '.join(data['checks'])}", data)
    command = str(data.get("command", ""))
    words = command.split()
    check = data.get("check") or (words[1] if len(words) > 1 else "")
    if check not in CHECKS:
        return None
    flags = data.get("engine_flags")
    return Report(path, check, list(flags) if isinstance(flags, list) else [], _headline(check, data), data)


def _headline(check: str, data: dict) -> str:
    if check == "kld":
        return f"kld: mean {data.get('kld_mean', float('nan')):.4f}, top-1 {100 * data.get('top1_agreement', 0):.1f}%"
    return f"{check}: {data.get('passed', '?')}/{data.get('items', '?')} passed"


def list_reports(folder: Path) -> list[Report]:
    """Every report in ``folder`` and its subfolders, newest first."""
    found = [r for p in folder.rglob("*.json") if (r := read_report(p)) is not None]
    return sorted(found, key=lambda r: r.path.stat().st_mtime, reverse=True)


class EvalReportsPanel(QWidget):
    """Reports on the left, the chosen one on the right, a Run row below. ``set_configuration(flags)`` tells it the
    launcher's configuration (ninfer-serve flags): it selects that configuration's last report and runs checks on
    it."""
    report_finished = Signal(str)  # the path of a report a Run produced

    def __init__(self, folder: Path | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.folder = Path(folder) if folder else reports_dir()
        self.flags: list[str] = []
        self.process: QProcess | None = None
        self._pending: Path | None = None
        self.list = QListWidget()
        self.view = QTextBrowser()
        self.view.setOpenLinks(False)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.list)
        split.addWidget(self.view)
        split.setStretchFactor(1, 3)
        self.check = QComboBox()
        self.check.addItems(CHECKS)
        self.options = QLineEdit()
        self.options.setPlaceholderText("check options, e.g. --lengths 512,1024 --seeds 2")
        self.run_button = QPushButton("Run check")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.output = QPlainTextEdit()
        self.output.setReadOnly(True)
        self.output.setMaximumBlockCount(2000)
        self.output.setVisible(False)
        row = QHBoxLayout()
        for w in (QLabel("Check:"), self.check, self.options, self.run_button, self.stop_button):
            row.addWidget(w)
        layout = QVBoxLayout(self)
        layout.addWidget(split, 1)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.output)
        self.list.currentItemChanged.connect(lambda item, _: self._show(item))
        self.run_button.clicked.connect(self.run_check)
        self.stop_button.clicked.connect(self.stop)
        self.refresh()

    # ---------------------------------------------------------------- reports

    def refresh(self, select: Path | None = None) -> None:
        self.list.clear()
        for r in list_reports(self.folder):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.path.stat().st_mtime))
            item = QListWidgetItem(f"{r.headline}\n{when} · {' '.join(r.flags) or 'default settings'}")
            item.setData(Qt.ItemDataRole.UserRole, r)
            self.list.addItem(item)
            if select is not None and r.path == select:
                self.list.setCurrentItem(item)
        if not self.list.count():
            self.view.setMarkdown(f"No evaluation reports in {self.folder} yet. Choose a check and press Run check, "
                                  "or run `ninfer-eval CHECK --json FILE` with FILE in this folder.")

    def reports(self) -> list[Report]:
        return [self.list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.list.count())]

    def current(self) -> Report | None:
        item = self.list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item else None

    def _show(self, item: QListWidgetItem | None) -> None:
        if item is None:
            return
        report: Report = item.data(Qt.ItemDataRole.UserRole)
        self.view.document().setBaseUrl(QUrl.fromLocalFile(str(report.path.parent) + "/"))
        self.view.setMarkdown(report.markdown())

    def set_configuration(self, flags: list[str]) -> Report | None:
        """The launcher's configuration (ninfer-serve flags); selects and returns its last report, if any."""
        self.flags = list(flags)
        for i in range(self.list.count()):
            r: Report = self.list.item(i).data(Qt.ItemDataRole.UserRole)
            if r.check != "compare" and r.flags == self.flags:
                self.list.setCurrentRow(i)
                return r
        self.status.setText("No report for this configuration yet." if self.list.count() else "")
        return None

    # ---------------------------------------------------------------- running a check

    def command(self) -> list[str]:
        """The arguments of ``python`` that run the chosen check on the configuration, writing a new report."""
        name = self.check.currentText()
        self._pending = self.folder / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        return ["-m", "engine.tools.eval", name, *self.flags, *shlex.split(self.options.text()), "--no-progress",
                "--json", str(self._pending), "--results", str(self.folder / "results.jsonl")]

    def run_check(self) -> None:
        try:
            args = self.command()
        except ValueError as e:
            self.status.setText(f"The check options cannot be read ({e}); fix the quotes.")
            return
        self.process = QProcess(self)
        self.process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        self.process.readyReadStandardOutput.connect(self._read_output)
        self.process.finished.connect(self._finished)
        self.output.clear()
        self.output.setVisible(True)
        self.run_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.status.setText(f"Running {self.check.currentText()}… (long contexts can take hours on a CPU; the "
                            "results file keeps finished items if you stop)")
        self.process.start(sys.executable, args)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()

    def _read_output(self) -> None:
        if self.process is not None:
            self.output.appendPlainText(bytes(self.process.readAllStandardOutput()).decode("utf-8", "replace")
                                        .rstrip())

    def _finished(self, code: int, _status) -> None:
        self._read_output()
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        done = self._pending is not None and self._pending.is_file()
        if code == 0 and done:
            self.status.setText("Done: the new report is selected.")
            self.refresh(select=self._pending)
            self.report_finished.emit(str(self._pending))
        else:
            self.status.setText(f"The check stopped (exit status {code}) before writing a report: see its output "
                                "below; run it again to continue from the results file.")
        self.process = None
