"""The monitor: decode speed, KV pages (GPU, and the host tier when the engine has one), retrieved pages, prefix
reuse, speculative decoding's acceptance, requests, VRAM (or, without an NVIDIA GPU, the RAM NInfer uses) and CPU;
curves over the last two minutes, about once a second. Each plot names its curves in its title (a legend inside
would cover them at small sizes), and the KV plot's zero sits above the axis so an empty pool still shows its line.

For the embedded engine it reads ``LocalService.stats()`` (a dict, no HTTP); for a remote server it reads that
server's ``/metrics`` (NInfer, vLLM or llama.cpp names) and says so when it offers nothing usable. VRAM comes from
NVML; without an NVIDIA driver the card says "no NVIDIA GPU" once, and shows RAM. The numbers and texts are computed
Qt-free in app/monitor/model.py.
"""
from __future__ import annotations

import time
from collections import deque

import pyqtgraph as pg
from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QGridLayout, QHBoxLayout, QLabel, QScrollArea, QVBoxLayout, QWidget

from app import theme
from app.asyncutil import spawn
from app.monitor.model import HostReader, Rates, VramReader, cards, local_values

HISTORY = 120  # samples (seconds)
INTERVAL_MS = 1000
MIN_BODY_HEIGHT = 440  # cards and plots keep a readable size; below it the panel scrolls


class _Stat(QFrame):
    def __init__(self, title: str):
        super().__init__()
        self.setObjectName("Card")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        t = self.title = QLabel(title)
        t.setObjectName("Muted")
        t.setWordWrap(True)
        self.value = QLabel("—")
        self.value.setStyleSheet("font-size: 13pt; font-weight: 700;")
        self.value.setWordWrap(True)
        self.detail = QLabel("")
        self.detail.setObjectName("Muted")
        self.detail.setWordWrap(True)
        layout.addWidget(t)
        layout.addWidget(self.value)
        layout.addWidget(self.detail)

    def set(self, value: str, detail: str = "") -> None:
        self.value.setText(value)
        self.detail.setText(detail)


class _Plot(pg.PlotWidget):
    """A plot that asks for a modest size: the panel's scroll area sizes its body from the size hints, and
    pyqtgraph's own (640 x 480) would make the body taller than the window."""

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return QSize(300, 160)


class MonitorPanel(QWidget):
    updated = Signal(dict)

    def __init__(self, controller, parent=None, vram: VramReader | None = None):
        super().__init__(parent)
        self.controller = controller
        self.vram = vram or VramReader()
        self.host = HostReader()
        self.updates = 0
        self.last: dict = {}
        self._inflight = False
        self.t0 = time.monotonic()
        self.series = {k: deque(maxlen=HISTORY) for k in ("decode_tps", "pages_used", "pages_free", "host_pages_used",
                                                          "vram_used", "ram_used")}
        self.times: deque = deque(maxlen=HISTORY)
        self.rates = Rates()
        self._build()
        self.timer = QTimer(self, interval=INTERVAL_MS)
        self.timer.timeout.connect(self.tick)
        self.timer.start()

    def _build(self) -> None:
        c = theme.colors()
        pg.setConfigOptions(antialias=True, foreground=c["plot_fg"], background=c["plot_bg"])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        scroll = QScrollArea()  # in a small window the panel scrolls instead of squeezing its cards and plots
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        outer.addWidget(scroll)
        body = QWidget()
        body.setMinimumHeight(MIN_BODY_HEIGHT)
        scroll.setWidget(body)
        layout = QVBoxLayout(body)
        head = QHBoxLayout()
        title = QLabel("Monitor")
        title.setObjectName("Section")
        head.addWidget(title)
        self.source = QLabel()
        self.source.setObjectName("Muted")
        head.addWidget(self.source, 1)
        layout.addLayout(head)
        self.note = QLabel()
        self.note.setObjectName("Banner")
        self.note.setWordWrap(True)
        self.note.setVisible(False)
        layout.addWidget(self.note)

        stats = QGridLayout()
        stats.setSpacing(8)
        self.stat_tps = _Stat("Decode speed")
        self.stat_kv = _Stat("KV cache pages")
        self.stat_prefix = _Stat("Prefix cache hits")
        self.stat_spec = _Stat("Speculative decoding")
        self.stat_req = _Stat("Requests")
        gpu = self.vram.handle is not None
        self.stat_vram = _Stat("VRAM" if gpu else "RAM (no GPU)")
        self.stat_cpu = _Stat("CPU")
        if not gpu:  # the reason (e.g. NVML's "Shared Library Not Found") only on hover
            self.stat_vram.setToolTip(f"{self.vram.note[:1].upper()}{self.vram.note[1:]}: showing the RAM NInfer "
                                      f"uses instead of VRAM." + (f"\nNVML: {self.vram.detail}" if self.vram.detail
                                                                 else ""))
        self.stat_cards = {"decode": self.stat_tps, "kv": self.stat_kv, "prefix": self.stat_prefix,
                           "spec": self.stat_spec, "requests": self.stat_req, "vram": self.stat_vram,
                           "cpu": self.stat_cpu}
        for i, w in enumerate(self.stat_cards.values()):
            stats.addWidget(w, i // 4, i % 4)
        layout.addLayout(stats)

        grid = QGridLayout()
        self.memory_key = "vram_used" if gpu else "ram_used"
        self.titles = {}  # plot -> (title, [(colour key, curve name)])
        self.plot_tps = self._plot("Decode tokens/s (last 5 s)", [("series1", "tok/s")])
        self.plot_kv = self._plot("KV pages", [("series1", "used"), ("series2", "free")])
        self.plot_vram = self._plot("VRAM used (MiB)" if gpu else "RAM used by NInfer (MiB)", [("series3", "used")])
        self.curve_tps = self.plot_tps.plot(pen=pg.mkPen(c["series1"], width=2))
        self.curve_used = self.plot_kv.plot(pen=pg.mkPen(c["series1"], width=2))
        self.curve_free = self.plot_kv.plot(pen=pg.mkPen(c["series2"], width=2))
        self.curve_host = None  # "host used", added once the engine reports a host tier
        self.curve_vram = self.plot_vram.plot(pen=pg.mkPen(c["series3"], width=2))
        grid.addWidget(self.plot_tps, 0, 0)
        grid.addWidget(self.plot_kv, 0, 1)
        grid.addWidget(self.plot_vram, 1, 0, 1, 2)
        grid.setRowStretch(0, 1)
        grid.setRowStretch(1, 1)
        layout.addLayout(grid, 1)

    def restyle(self) -> None:
        c = theme.colors()
        for plot in (self.plot_tps, self.plot_kv, self.plot_vram):
            plot.setBackground(c["plot_bg"])
            for side in ("left", "bottom"):
                axis = plot.getAxis(side)
                axis.setPen(pg.mkPen(c["plot_fg"]))
                axis.setTextPen(pg.mkPen(c["plot_fg"]))
            self._title(plot)
        for curve, key in ((self.curve_tps, "series1"), (self.curve_used, "series1"), (self.curve_free, "series2"),
                           (self.curve_vram, "series3"), (self.curve_host, "series5")):
            if curve is not None:
                curve.setPen(pg.mkPen(c[key], width=2))

    def _plot(self, title: str, names: list[tuple[str, str]]) -> pg.PlotWidget:
        w = _Plot()
        self.titles[w] = (title, names)
        self._title(w)
        w.showGrid(x=True, y=True, alpha=0.15)
        w.setLabel("bottom", "seconds")
        w.setMouseEnabled(x=False, y=False)
        w.hideButtons()
        w.setMinimumHeight(120)
        return w

    def _title(self, plot: pg.PlotWidget) -> None:
        """The title with each curve's colour and name (instead of a legend over the curves)."""
        c = theme.colors()
        title, names = self.titles[plot]
        keys = f"{title} " + " ".join(f'<span style="color:{c[key]}">■</span> {name}' for key, name in names)
        plot.setTitle(keys, size="10pt", color=c["plot_fg"])

    # ---- reading -----------------------------------------------------------------------------------------------------
    def tick(self) -> None:
        c = self.controller
        if c.remote:
            if not self._inflight and c.client is not None:
                self._inflight = True
                spawn(self._remote_tick(), "monitor-remote")
            return
        service = c.service
        if service is None:
            self.push({}, "no engine running", available=False)
            return
        s = service.stats()
        values = local_values(s, self.rates, time.monotonic())
        status = s.get("status")
        note = "" if status == "ready" else f"engine {status}" + (f": {s.get('error')}" if s.get("error") else "")
        self.push(values, f"this computer's engine · {s.get('device') or ''} · {s.get('url')}", note=note)

    async def _remote_tick(self) -> None:
        try:
            client = self.controller.client
            reading = await client.metrics()
            if reading.available:
                self.push(dict(reading.values), f"{client.endpoint.base_url}/metrics · {reading.note}")
            else:
                self.push({}, f"{client.endpoint.base_url}", note=f"The monitor cannot show this server: "
                                                                 f"{reading.note}.", available=False)
        finally:
            self._inflight = False

    def push(self, values: dict, source: str, note: str = "", available: bool = True) -> None:
        """One sample: updates the numbers and the curves."""
        vram = self.vram.read()
        if vram is not None:
            values["vram_used"], values["vram_total"] = vram
        values.update(self.host.read())
        self.last = values
        self.updates += 1
        self.source.setText(source)
        self.note.setText(note)
        self.note.setVisible(bool(note))
        now = time.monotonic() - self.t0
        self.times.append(now)
        for key, series in self.series.items():
            v = values.get(key)
            series.append(float(v) if isinstance(v, (int, float)) else float("nan"))
        xs = [t - now for t in self.times]
        self.curve_tps.setData(xs, list(self.series["decode_tps"]), connect="finite")
        self.curve_used.setData(xs, list(self.series["pages_used"]), connect="finite")
        self.curve_free.setData(xs, list(self.series["pages_free"]), connect="finite")
        if self.curve_host is None and isinstance(values.get("host_pages_used"), (int, float)):
            self.curve_host = self.plot_kv.plot(pen=pg.mkPen(theme.colors()["series5"], width=2))
            self.titles[self.plot_kv][1].append(("series5", "host used"))
            self._title(self.plot_kv)
        if self.curve_host is not None:
            self.curve_host.setData(xs, list(self.series["host_pages_used"]), connect="finite")
        self.curve_vram.setData(xs, list(self.series[self.memory_key]), connect="finite")
        self._fit_ranges(values)
        self._numbers(values, available)
        self.updated.emit(values)

    def _fit_ranges(self, v: dict) -> None:
        """Y ranges with room above the curves for the legend: tok/s up to 1.35x its peak, KV pages up to 1.35x the
        pool."""
        peak = max((x for x in self.series["decode_tps"] if x == x), default=0.0)
        self.plot_tps.setYRange(0, max(peak, 1.0) * 1.35, padding=0)
        used, free = v.get("pages_used"), v.get("pages_free")
        if isinstance(used, (int, float)) and isinstance(free, (int, float)) and used + free > 0:
            host = v.get("host_pages_used") if isinstance(v.get("host_pages_used"), (int, float)) else 0
            top = max(used + free, host) * 1.15
            self.plot_kv.setYRange(-0.04 * top, top, padding=0)  # zero just above the axis: an idle "used" shows

    def _numbers(self, v: dict, available: bool) -> None:
        for key, card in cards(v, available, self.vram.note, self.vram.name).items():
            self.stat_cards[key].set(card.value, card.detail)
