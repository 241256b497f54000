"""The windows at 800 x 600 (a laptop tiling two windows) and the monitor on a machine without an NVIDIA GPU."""
from __future__ import annotations

import pytest
from PySide6.QtWidgets import QLabel

from tests.app.conftest import clipped, make_controller, run, wait_until
from tests.app.fakes import FakeClient, FakeService


@pytest.fixture
def serving(qapp, qloop, app_home, request):
    controller = make_controller(app_home, request.node.name)
    service = FakeService()
    controller.service = service
    sampling = {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.0,
                "frequency_penalty": 0.0}  # what the engine reports in chat mode
    controller.client, controller.model_id = FakeClient({"mode": "chat", "sampling": sampling}), \
        "smollm2-135m-instruct"
    run(controller.refresh_mode())
    controller.show_main()
    yield controller, controller.window
    controller.quitting = True
    controller.client = None
    controller.window.hide()
    controller.launcher.hide()
    service.stop()


def test_the_main_window_fits_800x600(serving):
    controller, window = serving
    window.resize(800, 600)
    wait_until(lambda: (window.width(), window.height()) == (800, 600), 3000)
    assert window.minimumSizeHint().width() <= 800 and window.minimumSizeHint().height() <= 600
    for tab in (window.chat, window.monitor, window.server, window.logs, window.evals):
        window.tabs.setCurrentWidget(tab)
        wait_until(lambda: tab.isVisible(), 2000)
        assert (window.width(), window.height()) == (800, 600), tab
        assert not clipped(window), (type(tab).__name__, clipped(window))


def test_the_monitor_without_a_gpu_shows_ram_and_cpu(serving):
    from app.monitor.panel import MonitorPanel
    from app.monitor.model import VramReader

    controller, window = serving
    no_gpu = VramReader.__new__(VramReader)  # what VramReader leaves on a machine without the NVIDIA driver
    no_gpu.handle, no_gpu.name, no_gpu.note = None, "", "no NVIDIA GPU (no NVIDIA driver found)"
    no_gpu.detail = "NVML Shared Library Not Found"
    panel = MonitorPanel(controller, vram=no_gpu)
    panel.timer.stop()
    try:
        panel.resize(700, 520)
        panel.show()
        for _ in range(3):
            panel.tick()
        assert panel.stat_vram.title.text() == "RAM (no GPU)" and panel.stat_vram.value.text().endswith(" MiB")
        assert panel.stat_vram.detail.text().startswith("NInfer") and "GiB in use" in panel.stat_vram.detail.text()
        assert panel.stat_cpu.value.text().endswith("%") and "cores" in panel.stat_cpu.detail.text()
        texts = " ".join(label.text() for label in panel.findChildren(QLabel))
        assert "NVML" not in texts and "Library Not Found" not in texts  # the raw error is only in a tooltip
        assert "no NVIDIA driver found" in panel.stat_vram.toolTip() and "Library Not Found" in panel.stat_vram.toolTip()
        assert panel.plot_vram.isVisible() and "RAM used" in panel.plot_vram.plotItem.titleLabel.text
        assert all(x == x for x in panel.series["ram_used"])  # a real curve, not gaps
        assert panel.plot_kv.plotItem.legend is None and panel.plot_kv.getViewBox().viewRange()[1][0] < 0
    finally:
        panel.close()


def open_main(app_home, name: str):
    """The main window as the app opens it once the engine serves (a stand-in service and client)."""
    controller = make_controller(app_home, name)
    controller.service = FakeService()
    controller.client, controller.model_id = FakeClient({"mode": "chat", "sampling": {}}), "smollm2-135m-instruct"
    controller.show_main()
    return controller, controller.window


def test_the_main_window_and_a_saved_position_fit_a_1280x800_screen(qapp, qloop, app_home, monkeypatch):
    """#39 item 5: the default 1180 x 800 was taller than a 1280 x 800 screen's free area (its status bar below the
    screen's edge), and a position saved partly off-screen opened there."""
    from PySide6.QtCore import QRect
    from PySide6.QtGui import QScreen

    from app.widgets import DECORATION

    avail = QRect(0, 0, 1280, 770)  # a 1280 x 800 screen less a 30-pixel panel
    monkeypatch.setattr(QScreen, "availableGeometry", lambda self: QRect(avail))

    def fits(window) -> bool:  # the window with its frame and its status bar on the free area, room for a title bar
        status = window.statusBar()
        room = window.size().grownBy(DECORATION)
        bottom = status.mapToGlobal(status.rect().bottomLeft())
        return (avail.contains(window.frameGeometry()) and avail.contains(bottom)
                and room.width() <= avail.width() and room.height() <= avail.height())

    opened = []
    try:
        controller, window = open_main(app_home, "fit-1280")
        opened.append(controller)
        assert fits(window), window.geometry()
        assert window.width() >= 1100  # the default's width, as far as the screen has room
        window.resize(900, 650)
        window.move(700, 400)  # the user drags it half off the right and bottom edges ...
        window.close()  # ... and closes it to the tray
        assert not window.isVisible() and controller.service.serving
        controller.service.stop()
        again, reopened = open_main(app_home, "fit-1280")  # the next start
        opened.append(again)
        assert (reopened.width(), reopened.height()) == (900, 650)  # the size it was left at ...
        assert fits(reopened), reopened.geometry()  # ... moved whole onto the screen
        assert reopened.x() < 700 and reopened.y() < 400
        reopened.move(120, 60)  # a position on the screen comes back as it was
        reopened.close()
        again.service.stop()
        third, window = open_main(app_home, "fit-1280")
        opened.append(third)
        assert (window.x(), window.y()) == (120, 60) and fits(window)
    finally:
        for c in opened:
            c.quitting, c.client = True, None
            c.window.hide()
            c.service.stop()
