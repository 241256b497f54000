"""Drives the real app through a short session and saves screenshots (run by scripts/screenshots.sh under Xvfb).

    python -m app.screenshots OUT_DIR

Launcher (and the same launcher with a preset this version cannot run, its problems in words with fix links), a chat
while the answer streams, the finished answer (with a regenerated version and the chat's own settings open), the
monitor (on a machine without an NVIDIA GPU it shows RAM and CPU), the server panel open to the network, the chat in
the dark palette, and the launcher, chat and monitor at 800 x 600. It loads the embedded default
model and serves it on a free port; NINFER_HOME should point at an empty folder so nothing of yours is touched.
"""
from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ANSWER_TIMEOUT = 900  # seconds: a busy 2-core machine may decode only a few tokens a second


async def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def drive(app, controller, out: Path) -> None:
    from app import theme

    shots: list[Path] = []

    def save(widget, name: str) -> None:
        app.processEvents()
        path = out / name
        if not widget.grab().save(str(path)):
            raise RuntimeError(f"could not save {path}")
        shots.append(path)
        print(f"saved {path}", flush=True)

    launcher = controller.launcher
    launcher.resize(1180, 780)
    launcher.show()
    launcher.apply_config({"model": None, "preset": "12gb-mtp", "values": {}})
    await _until(lambda: launcher.report is not None and launcher.validation is not None
                 and launcher.validation.info is not None, 180, "the launcher's checks")
    await asyncio.sleep(0.5)
    save(launcher, "launcher-problems.png")

    launcher.apply_config({"model": None, "preset": "cpu-default",
                           "values": {"port": _free_port(), "max_context": 2048, "max_concurrency": 2}})
    await _until(launcher.start_button.isEnabled, 120, "Start to be enabled")
    await asyncio.sleep(0.5)
    save(launcher, "launcher.png")

    launcher.resize(800, 600)
    await asyncio.sleep(0.5)
    save(launcher, "launcher-800x600.png")
    launcher.resize(1180, 780)
    await asyncio.sleep(0.3)

    launcher.start()
    await _until(lambda: launcher.progress.value() > 150 or controller.window is not None, 120, "loading progress")
    save(launcher, "launcher-loading.png")
    await _until(lambda: controller.window is not None and controller.mode is not None, 300, "the model to load")
    window = controller.window
    window.resize(1280, 820)
    await asyncio.sleep(0.5)

    chat = window.chat
    chat.max_tokens = 160
    chat.send("Write a Python function that checks whether a word is a palindrome.")
    await _until(lambda: len(chat.messages[-1].content) > 140 or not chat.busy, 300, "the answer to start")
    chat.render()
    save(window, "chat-streaming.png")
    await _until(lambda: not chat.busy, ANSWER_TIMEOUT, "the answer to finish")
    chat.render()
    chat.max_tokens = 96
    chat.regenerate()  # a second version of the answer, to flip through
    await _until(lambda: not chat.busy, ANSWER_TIMEOUT, "the regenerated answer")
    chat.show_version(len(chat.messages) - 1, 0)
    chat.max_tokens = 160
    chat.system_toggle.setChecked(True)
    chat.system_prompt.setPlainText("You are a concise senior Python developer.")
    chat.render()
    await asyncio.sleep(0.5)
    save(window, "chat.png")
    chat.system_toggle.setChecked(False)
    window.resize(800, 600)
    await asyncio.sleep(0.5)
    save(window, "chat-800x600.png")
    window.resize(1280, 820)
    await asyncio.sleep(0.3)

    window.tabs.setCurrentWidget(window.monitor)
    chat.max_tokens = 64  # shorter answers: the monitor needs activity, not text
    for question in ("Explain what a palindrome is, with three examples.", "Now write the same function in Rust."):
        await asyncio.sleep(2)  # an idle gap between answers, as in real use
        chat.send(question)
        await _until(lambda: not chat.busy, ANSWER_TIMEOUT, "the answer to finish")
    await asyncio.sleep(1.2)
    save(window, "monitor.png")
    if window.monitor.vram.handle is None:  # this machine has no NVIDIA GPU: RAM and CPU instead of VRAM
        window.resize(800, 600)
        await asyncio.sleep(1.2)
        save(window, "monitor-no-gpu-800x600.png")
        window.resize(1280, 820)
    window.tabs.setCurrentWidget(window.server)
    server = window.server
    server.lan.setChecked(True)
    server.key.setText("sk-ninfer-screenshot-example-key")
    server.apply()
    await _until(lambda: server.apply_note.text() == "Applied." or server.apply_note.text().startswith("⚠"), 60,
                 "the server to open to the network")
    controller.state_changed.emit()
    await asyncio.sleep(1.2)
    save(window, "server.png")

    theme.apply(app, dark=True)
    controller.restyle()
    window.tabs.setCurrentWidget(chat)
    await asyncio.sleep(0.5)
    save(window, "chat-dark.png")
    theme.apply(app, dark=False)
    controller.restyle()
    print(f"{len(shots)} screenshots in {out}", flush=True)


async def start_embedded(controller, max_context: int):
    """The launcher started on the embedded model (cpu-default, a free port) until the main window serves it."""
    launcher = controller.launcher
    launcher.apply_config({"model": None, "preset": "cpu-default",
                           "values": {"port": _free_port(), "max_context": max_context, "max_concurrency": 2}})
    launcher.show()
    await _until(launcher.start_button.isEnabled, 180, "Start to be enabled")
    launcher.start()
    await _until(lambda: controller.window is not None and controller.mode is not None, 300, "the model to load")
    return controller.window


def screen_saver(app, out: Path):
    """``await save(name)``: the whole X screen (window frames included) as out/NAME-WxH.png, once the window
    manager has placed what was just shown."""
    from PySide6.QtGui import QGuiApplication

    screen = QGuiApplication.primaryScreen()
    size = f"{screen.geometry().width()}x{screen.geometry().height()}"

    async def save(name: str) -> None:
        await asyncio.sleep(1.0)
        app.processEvents()
        path = out / f"{name}-{size}.png"
        if not screen.grabWindow(0).save(str(path)):
            raise RuntimeError(f"could not save {path}")
        print(f"saved {path}", flush=True)

    return save


def run_session(drive, argv: list[str] | None, *, work: bool = False) -> int:
    """Runs ``await drive(app, controller, out)`` (``out``: the folder argv names, docs/screenshots by default; with
    ``work``, a throwaway folder as a fourth argument) in the app's event loop, then quits the app cleanly."""
    import tempfile

    import qasync
    from PySide6.QtWidgets import QApplication

    from app import theme
    from app.controller import Controller

    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "docs/screenshots").resolve()
    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("NInfer")
    app.setQuitOnLastWindowClosed(False)
    theme.apply(app, dark=False)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    controller = Controller(has_tray=False, quit_app=lambda: None)

    async def session(folder: str):
        try:
            await (drive(app, controller, out, Path(folder)) if work else drive(app, controller, out))
        finally:
            await controller.quit()

    with tempfile.TemporaryDirectory() as folder, loop:
        loop.run_until_complete(session(folder))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_session(drive, argv)


if __name__ == "__main__":
    sys.exit(main())
