"""Fixtures for the desktop app's tests (pytest-qt, offscreen).

- ``app_home`` (for every test here): NINFER_HOME points at a temporary folder for the whole package (settings,
  presets, conversations, the models' last use).
- ``qloop``: a qasync event loop marked as already running on the test's QApplication, so the app's coroutines run
  whenever Qt processes events (qtbot.waitUntil / qWait). It is taken down at the end of the package, so tests in
  other folders never see a running loop.
- ``started``: ONE embedded engine for the package, started through the launcher's Start button with the default
  model and a small context (max_context 1024); the flow tests share it.
"""
from __future__ import annotations

import asyncio
import os
import socket

import pytest
from PySide6.QtWidgets import QLabel, QPushButton

STARTUP_TIMEOUT_MS = 240_000  # loading the model on a busy 2-CPU machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package", autouse=True)
def app_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("ninfer-home")
    old = os.environ.get("NINFER_HOME")
    os.environ["NINFER_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("NINFER_HOME", None)
    else:
        os.environ["NINFER_HOME"] = old


@pytest.fixture(scope="package")
def qloop(qapp, app_home):
    import qasync

    from app import theme

    theme.apply(qapp, dark=False)
    loop = qasync.QEventLoop(qapp, already_running=True)
    asyncio.set_event_loop(loop)
    yield loop
    from app.server import logs
    logs.uninstall()
    asyncio.events._set_running_loop(None)
    loop._QEventLoop__is_running = False  # (qasync keeps it private) so the loop can be closed
    try:
        loop.close()
    except Exception:
        pass
    asyncio.set_event_loop(asyncio.new_event_loop())  # as fresh as before: later tests may ask for one


def wait_until(condition, timeout: int = 5000) -> None:
    """Processes Qt events (and so the app's coroutines) until ``condition()`` is true; fails after ``timeout`` ms.

    Unlike qtbot.waitUntil (QTest.qWait keeps the GIL while it waits), this sleeps between rounds, so the app's
    worker threads (model loading, hardware probe, the server) get the interpreter too."""
    import time

    from PySide6.QtCore import QCoreApplication, QEventLoop
    deadline = time.monotonic() + timeout / 1000
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} ms")
        QCoreApplication.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 20)
        time.sleep(0.01)


def run(coro, timeout: int = 30_000):
    """Runs a coroutine on the qasync loop while Qt processes events; returns its result."""
    task = asyncio.ensure_future(coro)
    wait_until(task.done, timeout=timeout)
    return task.result()


class Recorder:
    def __init__(self, result=None):
        self.calls = 0
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.result


def make_controller(app_home, name: str, **kw):
    from app.appconfig import AppConfig
    from app.controller import Controller
    from app.chat.store import ConversationStore

    kw.setdefault("has_tray", True)
    kw.setdefault("confirm_quit", Recorder(False))
    kw.setdefault("quit_app", Recorder())
    kw.setdefault("env", {})
    controller = Controller(config=AppConfig(app_home / f"{name}.json"),
                            store=ConversationStore(app_home / f"{name}.db"), **kw)
    _made.append(controller)
    return controller


_made: list = []  # controllers made by make_controller; those a test made are put away when it ends


@pytest.fixture(autouse=True)
def _put_away_controllers():
    """After each test, the controllers it made stop their timers and their windows are deleted: left running,
    every later test's event loop would serve their polls, repaints and monitor ticks too (tens of seconds in a
    full run). A package fixture's controller (``started``) is made before this snapshot and kept."""
    before = len(_made)
    yield
    from PySide6.QtCore import QCoreApplication, QEvent

    done, _made[before:] = _made[before:], []
    for controller in done:
        if controller.quitting and controller.window is None:
            continue
        controller.stop_views()
        for window in (controller.window, controller.library, controller.launcher):
            if window is not None:
                window.hide()
                window.deleteLater()
    if done:
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)


@pytest.fixture(scope="package")
def started(qapp, qloop, app_home):
    """(controller, window): the embedded default model served on a free port, started with the Start button."""
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    controller = make_controller(app_home, "flow")
    launcher = controller.launcher
    launcher.show()
    form = launcher.form
    port = free_port()
    form.set_value("port", port)
    form.set_value("max_context", 1024)
    form.set_value("max_concurrency", 2)
    try:  # the hardware probe and the model's check run in threads: slow on a busy 2-CPU machine
        wait_until(launcher.start_button.isEnabled, timeout=STARTUP_TIMEOUT_MS)
    except TimeoutError as e:
        checks = launcher.validation.checks if launcher.validation is not None else []
        raise TimeoutError(f"{e}: Start stayed disabled; status {launcher.status.text()!r}, probe done: "
                           f"{launcher.report is not None}, checks: {[c.message for c in checks]}") from e
    QTest.mouseClick(launcher.start_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: controller.window is not None and controller.client is not None
               and controller.mode is not None, timeout=STARTUP_TIMEOUT_MS)
    yield controller, controller.window
    if not controller.quitting:
        task = asyncio.ensure_future(controller.quit())
        wait_until(task.done, timeout=60_000)


def clipped(root) -> list[str]:
    """Visible labels and buttons smaller than their text needs (text cut off): too narrow, or a wrapped label
    too short for its lines."""
    out = []
    for widget in root.findChildren(QLabel) + root.findChildren(QPushButton):
        if not widget.isVisibleTo(root) or not widget.text():
            continue
        if isinstance(widget, QLabel) and widget.wordWrap():
            need = widget.heightForWidth(widget.width())
            if need > widget.height() + 1:
                out.append(f"QLabel {widget.text()[:40]!r}: height {widget.height()} < {need}")
            continue
        need = (widget.sizeHint() if isinstance(widget, QPushButton) else widget.minimumSizeHint()).width()
        if widget.width() < need - 1:  # (a styled button's minimum size hint leaves out its padding)
            out.append(f"{type(widget).__name__} {widget.text()[:40]!r}: {widget.width()} < {need}")
    return out
