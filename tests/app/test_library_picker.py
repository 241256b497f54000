"""The app's model picker is the model library: against a stand-in hub on the loopback (HF_ENDPOINT), search, pick a
file marked "fits", download it with progress, load it, chat; then switch the running engine to a model from a
folder without a restart (same service, same port) and chat with it; last use and remove in the local list. The
launcher's check of an hf: reference never downloads."""
from __future__ import annotations

import shutil
import time

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog
from PySide6.QtTest import QTest

from app.library.rows import hub_reference, last_used_text, params_text, progress_text, size_text
from engine.library.download import DownloadProgress
from engine.library.local import EMBEDDED_NAME
from engine.model.default import default_model_path
from tests.app.conftest import clipped, free_port, make_controller, run, wait_until
from tests.library.conftest import Repo, hf_home, hub  # noqa: F401 (fixtures: the stand-in hub, a fresh HF_HOME)

REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
QUESTION = "What is the capital of France? Answer in one sentence."
LOAD_TIMEOUT = 240_000


def click(button) -> None:
    assert button.isEnabled(), button.text()
    QTest.mouseClick(button, Qt.MouseButton.LeftButton)


def chat_answer(window, text: str) -> str:
    chat = window.chat
    chat.max_tokens = 48
    chat.open(None)
    assert chat.send(text)
    wait_until(lambda: not chat.busy, timeout=LOAD_TIMEOUT)
    return chat.messages[-1].content


@pytest.fixture
def published(hub, hf_home, tmp_path, monkeypatch):  # noqa: F811
    from engine.model.default import default_model_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no LM Studio or Ollama store of the machine's user
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    source = default_model_path()
    hub.add(Repo(REPO, {source.name: source.read_bytes()}))
    return source


def test_the_launchers_check_of_an_hf_reference_never_downloads(published, hub):  # noqa: F811
    from app.launcher.validation import model_check

    info, problem = model_check(f"hf:{REPO}:Q4_1")
    assert info is None and "has not been downloaded yet" in problem.message
    assert not [r for r in hub.requests if "/resolve/" in r[1] or r[1].startswith("/api/")]


@pytest.mark.slow
def test_search_fit_download_load_chat_switch_remove(qapp, qloop, app_home, published, hub, hf_home, tmp_path,  # noqa: F811
                                                     monkeypatch):
    controller = make_controller(app_home, "library")
    launcher = controller.launcher
    for name, value in (("port", free_port()), ("max_context", 1024), ("max_concurrency", 1)):
        launcher.form.set_value(name, value)
    launcher.show()
    controller.show_library()
    library = controller.library
    find = library.find
    assert library.isVisible() and library.tabs.currentWidget() is find

    QTest.keyClicks(find.query, "smollm2")
    click(find.search_button)
    wait_until(lambda: find.repos.count() == 1, 20_000)
    assert find.repos.item(0).text().startswith(REPO) and "llama" in find.repos.item(0).text()
    find.repos.setCurrentRow(0)
    name = published.name
    wait_until(lambda: name in find.marks, 60_000)
    assert find.marks[name].mark == "fits", str(find.marks[name])  # 135M parameters, 1024 tokens: fits anywhere
    assert find.files.item(0, 0).text() == name and find.files.item(0, 1).text() == "Q4_1"
    assert find.files.item(0, 3).text() == "fits" and find.files.item(0, 2).text() == size_text(published.stat().st_size)
    assert not [r for r in hub.requests if r[1].endswith(name) and r[0] == "GET" and not r[2]]  # only its header
    find.select_file(name)
    assert "fits" in find.detail.text() and not find.load_button.isEnabled()

    reports: list[DownloadProgress] = []
    find.progress_signal.connect(reports.append)
    started = time.monotonic()
    click(find.download_button)
    assert find.progress.isVisible() and find.cancel_button.isVisible() and not find.download_button.isEnabled()
    wait_until(lambda: find.downloading is None, 120_000)
    elapsed = time.monotonic() - started
    assert "Downloaded" in find.status.text() and "verified" in find.status.text(), find.status.text()
    size = published.stat().st_size
    assert reports and reports[-1].done == reports[-1].total == size
    assert [p.done for p in reports] == sorted(p.done for p in reports) and any(p.rate > 0 for p in reports)
    # every redraw draws a report not drawn before (never a stale one), at most one per 200 ms tick plus the last;
    # that a burst of reports is drawn once per tick: test_a_burst_of_progress_reports_is_drawn_once_per_tick
    assert 1 <= find.progress_shown <= min(len(reports), elapsed / 0.2 + 2), (find.progress_shown, len(reports))
    assert find.progress.value() == 1000  # the last report was drawn before the bar was hidden, not a stale one
    path = find.paths[name]
    assert path.is_relative_to(hf_home / "hub") and path.read_bytes() == published.read_bytes()
    assert not find.progress.isVisible()

    click(find.load_button)  # nothing runs yet: the launcher starts it once its checks pass
    assert launcher.model == f"hf:{REPO}:Q4_1"
    wait_until(lambda: controller.window is not None and controller.client is not None
               and controller.mode is not None, LOAD_TIMEOUT)
    service, window = controller.service, controller.window
    port = service.port
    assert service.model_ids == ["SmolLM2-135M-Instruct.Q4_1"] and service.model_path == path
    assert "Paris" in chat_answer(window, QUESTION)

    # switch to a model from an added folder: same service, same port, no restart
    folder = tmp_path / "my-models"
    folder.mkdir()
    shutil.copyfile(published, folder / "my-copy.gguf")
    local = library.local
    library.tabs.setCurrentWidget(local)
    scans = local.scans
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    click(local.add_button)  # the button a user clicks, through its folder dialog
    wait_until(lambda: local.scans > scans, 30_000)
    names = [m.name for m in local.models]
    assert set(names) == {f"{REPO}/{name}", "my-copy.gguf", EMBEDDED_NAME}, names
    row = names.index(f"{REPO}/{name}")
    assert local.table.item(row, 7).text() == "just now"  # last used: it is the model loaded now
    assert [local.table.item(row, c).text() for c in (1, 2, 4, 5)] == ["huggingface", "llama", "Q4_1", "8,192"]
    local.select("my-copy.gguf")
    assert local.table.item(local.table.currentRow(), 7).text() == "never"
    click(local.load_button)
    seen = {local.status.text()}
    wait_until(lambda: seen.add(local.status.text()) or controller.switching or service.status != "ready", 10_000)
    wait_until(lambda: seen.add(local.status.text()) or (not controller.switching and controller.model_id == "my-copy"),
               LOAD_TIMEOUT)
    assert any(t.startswith("Loading my-copy.gguf…") for t in seen), seen
    # the status line says it serves, and the list read again shows it used just now (no Refresh clicked)
    wait_until(lambda: local.status.text().startswith("my-copy.gguf is loaded and serving."), 20_000)
    row = [m.name for m in local.models].index("my-copy.gguf")
    assert local.table.item(row, 7).text() == "just now"
    assert controller.service is service and service.port == port and service.serving
    assert service.model_ids == ["my-copy"] and "my-copy" in window.status_label.text()
    assert "Paris" in chat_answer(window, QUESTION)

    # and back to the model that comes with the app, from the same list
    local.select(EMBEDDED_NAME)
    click(local.load_button)
    wait_until(lambda: controller.switching or service.status != "ready", 10_000)
    wait_until(lambda: not controller.switching and service.status == "ready", LOAD_TIMEOUT)
    assert service.model_path == default_model_path() and launcher.model is None, service.model_path

    # remove the download (ours); the copy in the user's folder is theirs
    local.select("my-copy.gguf")
    click(local.remove_button)
    assert "belongs to folder" in local.status.text() and (folder / "my-copy.gguf").exists()
    local.confirm_remove = lambda m: True
    local.select(f"{REPO}/{name}")
    scans = local.scans
    click(local.remove_button)
    wait_until(lambda: local.scans > scans, 30_000)
    assert sorted(m.name for m in local.models) == [EMBEDDED_NAME, "my-copy.gguf"] and not path.exists()
    run(controller.quit(), 60_000)


def test_the_rows_text():
    assert size_text(98_362_432) == "93.8 MiB" and size_text(3 * 2**30) == "3.00 GiB"
    assert params_text(134_515_008) == "134.5M" and params_text(8_030_000_000) == "8B" and params_text(0) == "?"
    assert last_used_text(None) == "never" and last_used_text(1000.0, now=1030.0) == "just now"
    assert last_used_text(0.0, now=3 * 3600) == "3 h ago" and last_used_text(0.0, now=5 * 60) == "5 min ago"
    assert progress_text(DownloadProgress(2**20 * 41, 2**20 * 98, 2**20 * 12.5, 4.6)) == \
        "41.0 of 98.0 MiB · 12.5 MiB/s · 5 s left"
    assert progress_text(DownloadProgress(0, 2**30, 0.0, None)) == "0.0 of 1024.0 MiB · starting"
    assert hub_reference("o/r", "Q4_K_M", 1) == "hf:o/r:Q4_K_M"
    assert hub_reference("o/r", "Q4_K_M", 2) is None and hub_reference("o/r", "", 1) is None


def test_cancel_a_download_then_continue_it(qapp, qloop, app_home, hub, hf_home, tmp_path):  # noqa: F811
    """Cancel stops a download mid-way and leaves nothing the library would load; Download again continues from the
    bytes on disk (a range request) and the file verifies."""
    from tests.library.conftest import write_gguf

    data = write_gguf(tmp_path / "Tiny-Q8_0.gguf", pad_mib=4).read_bytes()
    hub.add(Repo("test-org/Tiny-GGUF", {"Tiny-Q8_0.gguf": data}))
    hub.rate = 2 * 2**20  # two seconds for the whole file
    controller = make_controller(app_home, "library-cancel")
    controller.show_library()
    find, local = controller.library.find, controller.library.local
    find.query.setText("tiny")
    click(find.search_button)
    wait_until(lambda: find.repos.count() == 1, 20_000)
    find.repos.setCurrentRow(0)
    wait_until(lambda: "Tiny-Q8_0.gguf" in find.marks, 30_000)
    find.select_file("Tiny-Q8_0.gguf")
    controller.library.resize(800, 600)  # the smallest size the app supports: nothing cut off
    wait_until(lambda: controller.library.width() == 800, 5000)
    assert clipped(controller.library) == []
    reports: list[DownloadProgress] = []
    find.progress_signal.connect(reports.append)
    click(find.download_button)
    wait_until(lambda: find.progress_shown >= 1 and "MiB/s" in find.status.text(), 20_000)
    assert "Downloading Tiny-Q8_0.gguf:" in find.status.text() and " of " in find.status.text()
    assert 0 < find.progress.value() < 1000
    click(find.cancel_button)
    wait_until(lambda: find.downloading is None, 20_000)
    assert "cancelled" in find.status.text() and not find.load_button.isEnabled()
    cut_at = reports[-1].done
    assert 0 < cut_at < len(data)
    storage = hf_home / "hub" / "models--test-org--Tiny-GGUF"
    assert not list(storage.glob("snapshots/*/*.gguf"))  # nothing the library lists or loads
    scans = local.scans
    local.refresh()
    wait_until(lambda: local.scans > scans, 20_000)
    assert [m.name for m in local.models] == [EMBEDDED_NAME]  # no partial download listed

    hub.rate = 0
    reports.clear()
    click(find.download_button)
    wait_until(lambda: find.downloading is None, 30_000)
    assert "verified" in find.status.text() and find.load_button.isEnabled()
    assert find.paths["Tiny-Q8_0.gguf"].read_bytes() == data
    resumed = [r for r in hub.requests if r[1].endswith("Tiny-Q8_0.gguf") and r[0] == "GET"][-1]
    assert resumed[2].startswith("bytes=") and int(resumed[2][6:].split("-")[0]) >= cut_at
    wait_until(lambda: sorted(m.name for m in local.models) == [EMBEDDED_NAME, "test-org/Tiny-GGUF/Tiny-Q8_0.gguf"],
               20_000)
    run(controller.quit(), 30_000)


def test_a_burst_of_progress_reports_is_drawn_once_per_tick(qtbot):
    """The download thread may report far faster than the eye needs: the bar keeps the latest report and the
    redraw timer draws it once; a tick without a new report draws nothing."""
    from types import SimpleNamespace

    from app.library.find import FindPanel
    from engine.library.download import DownloadProgress

    panel = FindPanel(controller=None)
    qtbot.addWidget(panel)
    panel.downloading = SimpleNamespace(filename="model.gguf")
    for done in range(1, 51):
        panel._progress_arrived(DownloadProgress(done=done * 20, total=1000, rate=100.0, eta_s=1.0))
    panel._redraw_progress()
    assert panel.progress_shown == 1 and panel.progress.value() == 1000  # one redraw, of the last report
    panel._redraw_progress()
    assert panel.progress_shown == 1  # nothing new: nothing drawn
