"""Whole-screen pictures of the app on a real X screen with a window manager (run by scripts/screen_check.sh under
Xvfb with openbox, once per screen size):

    python -m app.screenshots_screen OUT_DIR

What a user sees on that screen, window frames included: the main window as the app opens it once the embedded
model serves (its status bar must be on the screen), the model library's On this computer list (the embedded model,
a folder of small models, their fit marks, the loaded badge), and the launcher after File > Change model or
settings with the server opened to the network (the LAN address and the key kept). Files are named after the
screen, e.g. main-1280x800.png. NINFER_HOME, HF_HOME and HOME should point at empty folders.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from app.screenshots import _until, run_session, screen_saver, start_embedded


def _models_folder(work: Path) -> Path:
    """A folder of small GGUF files for the library's list: two llamas the engine runs and a Mamba it does not."""
    from tests.library.conftest import write_gguf

    folder = work / "models"
    folder.mkdir()
    for name in ("Tiny-Llama-Q4_K_M.gguf", "Tiny-Llama-Q8_0.gguf"):
        write_gguf(folder / name, context=4096, pad_mib=2)
    write_gguf(folder / "Tiny-Mamba-Q8_0.gguf", arch="mamba")
    return folder


def _trigger(window, text: str) -> None:
    """Clicks the menu entry ``text`` of the main window's menu bar."""
    for menu in window.menuBar().actions():
        for action in menu.menu().actions():
            if action.text() == text:
                action.trigger()
                return
    raise LookupError(f"no menu entry {text!r}")


async def drive(app, controller, out: Path, work: Path) -> None:
    from app.library.local import FOLDERS_KEY

    save = screen_saver(app, out)

    window = await start_embedded(controller, 2048)
    await save("main")

    controller.config.set(FOLDERS_KEY, [str(_models_folder(work))])
    _trigger(window, "Model library…")
    library = controller.library
    library.tabs.setCurrentWidget(library.local)
    library.local.refresh()
    await _until(lambda: library.local.marked and library.local.marked == library.local.scans, 120, "the fit marks")
    library.local.table.selectRow(0)
    library.raise_()
    await save("library-local")
    library.hide()

    server = window.server
    window.tabs.setCurrentWidget(server)
    server.lan.setChecked(True)
    server.key.setText("sk-ninfer-screenshot-example-key")
    server.apply()
    await _until(lambda: server.apply_note.text() == "Applied." or server.apply_note.text().startswith("⚠"), 60,
                 "the server to open to the network")
    _trigger(window, "Change model or settings…")
    await _until(lambda: controller.window is None or not controller.window.isVisible(), 60, "the launcher")
    launcher = controller.launcher
    await _until(lambda: launcher.isVisible() and launcher.start_button.isEnabled(), 120, "the launcher's checks")
    await save("launcher-change-model")


def main(argv: list[str] | None = None) -> int:
    return run_session(drive, argv, work=True)


if __name__ == "__main__":
    sys.exit(main())
