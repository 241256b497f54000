"""Screenshots of the model library (run by scripts/screenshots.sh after the main session, or alone):

    python -m app.screenshots_library OUT_DIR

The hub is the tests' stand-in for Hugging Face on the loopback (tests/library/conftest.py), publishing the embedded
default model and two tiny GGUF files written with the gguf package, so the pictures are the same on any machine,
without a network. Saves the Find tab with its fit marks (library-find.png), a download under way with its rate and
time left (library-download.png; the stand-in serves at 8 MiB/s so there is one to see) and the models on this
computer after the downloaded model was loaded from the library (library-local.png). Needs the test extras
(pytest, gguf). NINFER_HOME, HF_HOME and HOME should point at empty folders so nothing of yours is shown or touched.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from app.screenshots import _free_port, _until, run_session

REPO = "local-demo/SmolLM2-135M-Instruct-GGUF"


def _stand_in_hub(work: Path):
    """The stand-in hub, serving: the embedded model, a tiny llama in two quants, and a tiny Mamba (which this
    engine cannot run, so it shows that mark)."""
    from engine.model.default import default_model_path
    from tests.library.conftest import Repo, StandInHub, _handler, write_gguf

    hub = StandInHub()
    source = default_model_path()
    hub.add(Repo(REPO, {source.name: source.read_bytes()}, downloads=5000, parameters=134_515_008))
    tiny = {name: write_gguf(work / name, context=4096, pad_mib=2).read_bytes()
            for name in ("Tiny-Llama-Q4_K_M.gguf", "Tiny-Llama-Q8_0.gguf")}
    hub.add(Repo("local-demo/Tiny-Llama-GGUF", tiny, downloads=1200))
    hub.add(Repo("local-demo/Tiny-Mamba-GGUF", {"Tiny-Mamba-Q8_0.gguf": write_gguf(
        work / "Tiny-Mamba-Q8_0.gguf", arch="mamba").read_bytes()}, architecture="mamba", downloads=300))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    return hub, server


async def drive(app, controller, out: Path, work: Path) -> None:
    def save(widget, name: str) -> None:
        app.processEvents()
        path = out / name
        if not widget.grab().save(str(path)):
            raise RuntimeError(f"could not save {path}")
        print(f"saved {path}", flush=True)

    hub, server = _stand_in_hub(work)
    os.environ["HF_ENDPOINT"] = hub.url
    try:
        launcher = controller.launcher
        launcher.apply_config({"model": None, "preset": "cpu-default",
                               "values": {"port": _free_port(), "max_context": 2048, "max_concurrency": 2}})
        controller.show_library()
        library = controller.library
        library.resize(1100, 640)
        find = library.find
        find.query.setText("gguf")
        find.search()
        await _until(lambda: find.repos.count() == 3, 30, "the search results")
        find.repos.setCurrentRow(0)
        name = "SmolLM2-135M-Instruct.Q4_1.gguf"
        await _until(lambda: name in find.marks, 60, "the fit marks")
        find.select_file(name)
        await asyncio.sleep(0.5)
        save(library, "library-find.png")

        hub.rate = 8 * 2**20
        find.download()
        await _until(lambda: find.progress.value() > 300, 60, "the download to be under way")
        save(library, "library-download.png")
        hub.rate = 0
        await _until(lambda: find.downloading is None, 120, "the download to finish")

        find.load()
        await _until(lambda: controller.window is not None and controller.mode is not None, 300, "the model to load")
        controller.window.hide()
        library.tabs.setCurrentWidget(library.local)
        library.local.refresh()
        await _until(lambda: library.local.models and library.local.table.rowCount(), 30, "the local list")
        library.local.table.selectRow(0)
        library.show()
        library.raise_()
        await asyncio.sleep(0.5)
        save(library, "library-local.png")
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    os.environ.pop("HF_HUB_OFFLINE", None)  # the stand-in hub is on the loopback
    from huggingface_hub import constants
    constants.HF_HUB_OFFLINE = False
    return run_session(drive, argv, work=True)


if __name__ == "__main__":
    sys.exit(main())
