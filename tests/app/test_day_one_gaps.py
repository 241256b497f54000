"""The day-one gaps next to LM Studio and Jan, through what a user sees and clicks: answers say which model wrote
them after a switch (kept in the conversation store, old databases still open), the chat header shows the
conversation's own sampling, On this computer shows fit marks and which model is loaded, and with the API open to
the network the snippets, the tray's Copy API URL and the status bar give the address other computers use."""
from __future__ import annotations

import sqlite3

import pytest
from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QFontMetrics
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QPushButton, QStyle

from tests.app.conftest import make_controller, run, wait_until
from tests.app.fakes import FakeClient, FakeService
from tests.library.conftest import hf_home  # noqa: F401 (a fixture: a fresh HF_HOME)

CHAT = {"mode": "chat", "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 40}}
SWITCHED = "smollm2-135m-instruct"


def open_chat(app_home, name: str, client: FakeClient | None = None):
    controller = make_controller(app_home, name)
    client = client or FakeClient(dict(CHAT))
    controller.client, controller.model_id = client, "fake-model"
    run(controller.refresh_mode())
    controller.show_main()
    return controller, controller.window, client


@pytest.fixture
def chat_window(qapp, qloop, app_home, request):
    controller, window, client = open_chat(app_home, request.node.name)
    yield controller, window, client
    controller.quitting = True
    controller.client = None
    window.hide()


def send(chat, text: str) -> None:
    """Types a message and clicks Send, then waits for the answer (and for Send to be enabled again)."""
    wait_until(chat.send_button.isEnabled, 5000)
    QTest.keyClicks(chat.input, text)
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    assert not chat.input.toPlainText(), "the message was not sent"
    wait_until(lambda: not chat.busy and chat.streaming is None and chat.send_button.isEnabled(), 10_000)


def click_conversation(window, row: int) -> None:
    lst = window.conversations.list
    QTest.mouseClick(lst.viewport(), Qt.MouseButton.LeftButton, pos=lst.visualItemRect(lst.item(row)).center())


def switch_model(controller, model: str) -> None:
    """What the controller does once the engine serves another model (the library's Load, the launcher)."""
    controller.model_id = model
    controller.state_changed.emit()


# ---- 1. answers record the model that wrote them ---------------------------------------------------------------------
def test_answers_name_their_model_after_a_switch_and_keep_it(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    client.words = ["Paris."]
    send(chat, "Capital of France?")
    assert "fake-model" not in chat.view.toPlainText()  # one model, the one loaded: nothing to tell apart
    switch_model(controller, SWITCHED)
    assert "Assistant · fake-model" in chat.view.toPlainText()  # the earlier answer was not written by this model
    client.words = ["Rome."]
    send(chat, "And of Italy?")
    text = chat.view.toPlainText()
    assert "Assistant · fake-model" in text and f"Assistant · {SWITCHED}" in text
    conv = chat.conversation.id
    stored = [m.model for m in controller.store.messages(conv) if m.role == "assistant"]
    assert stored == ["fake-model", SWITCHED]
    window.new_chat()
    click_conversation(window, 0)  # opened again from the list: read back from the store
    assert chat.conversation.id == conv
    assert [m.model for m in chat.messages if m.role == "assistant"] == ["fake-model", SWITCHED]
    assert "Assistant · fake-model" in chat.view.toPlainText()
    client.words = ["Rome, still."]
    QTest.mouseClick(chat.regen_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: not chat.busy and chat.streaming is None and chat.regen_button.isEnabled(), 10_000)
    switch_model(controller, "fake-model")  # back to the first model; the new version is the second one's
    last = len(chat.messages) - 1
    assert "version 2 of 2" in chat.view.toPlainText() and f"Assistant · {SWITCHED}" in chat.view.toPlainText()
    client.words = ["Roma."]
    QTest.mouseClick(chat.regen_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: not chat.busy and chat.streaming is None and chat.regen_button.isEnabled(), 10_000)
    assert chat.messages[last].model == "fake-model"
    chat._link(QUrl(f"ninfer:version/{last}/1"))  # the ‹ link back to the version the other model wrote
    assert chat.messages[last].model == SWITCHED


def test_a_database_from_before_models_were_recorded_still_opens(qapp, qloop, app_home, request):
    path = app_home / f"{request.node.name}.db"
    db = sqlite3.connect(str(path))
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL,
            position INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL DEFAULT '',
            reasoning TEXT NOT NULL DEFAULT '', tool_calls TEXT NOT NULL DEFAULT '[]',
            stats TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
        INSERT INTO conversations VALUES (1, 'Old talk', '', 1.0, 1.0);
        INSERT INTO messages VALUES (1, 1, 0, 'user', 'Hi there', '', '[]', '{}', 1.0);
        INSERT INTO messages VALUES (2, 1, 1, 'assistant', 'Hello from long ago', '', '[]', '{"tokens": 4}', 1.0);
    """)
    db.commit()
    db.close()
    controller, window, client = open_chat(app_home, request.node.name)
    chat = window.chat
    click_conversation(window, 0)
    assert "Hello from long ago" in chat.view.toPlainText() and "Assistant ·" not in chat.view.toPlainText()
    switch_model(controller, SWITCHED)
    send(chat, "Still there?")
    assert [m.model for m in controller.store.messages(1) if m.role == "assistant"] == ["", SWITCHED]
    controller.quitting, controller.client = True, None


# ---- 3. the chat header shows the conversation's own sampling --------------------------------------------------------
def test_the_header_shows_this_conversations_own_sampling(chat_window):
    controller, window, client = chat_window
    chat = window.chat
    header = chat.sampling_label
    assert header.text() == "temperature 0.7 · top_p 0.95 · top_k 40"  # nothing of its own: the mode's values
    QTest.mouseClick(chat.system_toggle, Qt.MouseButton.LeftButton)  # Chat settings
    spins = chat.options.spins
    spins["temperature"].setValue(0.3)
    assert header.text().startswith("This chat: temperature 0.3") and "temperature 0.7" not in header.text()
    assert "top_p 0.95" in header.text()  # the rest still follows the mode
    spins["max_tokens"].setValue(77)
    assert header.text().startswith("This chat: temperature 0.3 · max tokens 77")
    send(chat, "Hello")
    first = chat.conversation.id
    QTest.mouseClick(window.conversations.new_button, Qt.MouseButton.LeftButton)
    assert header.text() == "temperature 0.7 · top_p 0.95 · top_k 40"  # a new chat follows the mode
    send(chat, "Another")
    row = [window.conversations.list.item(i).data(Qt.ItemDataRole.UserRole)
           for i in range(window.conversations.list.count())].index(first)
    click_conversation(window, row)
    assert header.text().startswith("This chat: temperature 0.3 · max tokens 77")
    reset = next(b for b in chat.options.findChildren(QPushButton) if b.text() == "Use the mode's values")
    QTest.mouseClick(reset, Qt.MouseButton.LeftButton)
    assert header.text() == "temperature 0.7 · top_p 0.95 · top_k 40"


# ---- 2. On this computer: fit marks and the loaded model -------------------------------------------------------------
@pytest.fixture
def library(qapp, qloop, app_home, hf_home, tmp_path, monkeypatch, request):  # noqa: F811
    """(controller, the On this computer panel, memory): the embedded model served by a stand-in service, the
    machine's memory a list the test changes."""
    from engine.library import fit
    from engine.model.default import default_model_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no LM Studio or Ollama store of the machine's user
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    memory = [(0, 16_000)]
    monkeypatch.setattr(fit, "machine_memory", lambda: memory[0])
    controller = make_controller(app_home, request.node.name)
    service = FakeService()
    service.model_path = default_model_path()
    controller.service = service
    controller.show_library()  # File ▸ Model library…
    local = controller.library.local
    controller.library.tabs.setCurrentWidget(local)  # the On this computer tab
    yield controller, local, memory
    controller.service = None
    service.stop()


def fit_cell(local, name: str):
    from app.library.local import COLUMNS

    row = [m.name for m in local.models].index(name)
    return local.table.item(row, COLUMNS.index("Fit on this computer")), local.table.item(row, 0)


def test_on_this_computer_marks_each_model_and_badges_the_loaded_one(library):
    from pathlib import Path

    from engine.library.local import EMBEDDED_NAME

    controller, local, memory = library
    wait_until(lambda: local.marked >= 1, 60_000)
    mark, name = fit_cell(local, EMBEDDED_NAME)
    assert mark.text() == "fits", mark.toolTip()
    assert "8,192 tokens" in mark.toolTip() and "no GPU and 16,000 MiB RAM available" in mark.toolTip()
    assert name.text() == f"{EMBEDDED_NAME}  ● loaded" and name.font().bold()
    window = controller.library  # a narrow library window: the name is cut, the badge still shows
    window.show()
    window.resize(860, 640)
    QApplication.processEvents()
    table = local.table
    room = table.columnWidth(0) - 2 * table.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin) - 8
    assert not table.wordWrap()  # (a wrapped cell is cut at its line's end whatever the elide mode)
    drawn = QFontMetrics(name.font()).elidedText(name.text(), table.textElideMode(), room)
    assert drawn.endswith(" loaded"), (drawn, room)  # (cut in the middle: "SmolLM2… loaded")
    window.resize(600, 500)  # narrower than the other columns need: the names keep their width, the table scrolls
    QApplication.processEvents()
    assert table.columnWidth(0) >= 220 and table.horizontalScrollBar().maximum() > 0
    controller.service.model_path = Path("another-model.gguf")  # the server runs another model now
    controller.state_changed.emit()
    assert name.text() == EMBEDDED_NAME and not name.font().bold()
    memory[0] = (0, 100)  # a machine with far less memory free
    scans = local.marked
    QTest.mouseClick(local.refresh_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: local.marked > scans, 60_000)
    mark, _ = fit_cell(local, EMBEDDED_NAME)
    assert mark.text() == "needs more memory" and "GiB" in mark.toolTip() and "100 MiB RAM" in mark.toolTip()


def test_a_35b_moe_file_added_on_a_12_gib_gpu_is_marked_fits_with_host_experts(library, tmp_path, monkeypatch):
    """Add folder… (the button) with a Qwen3.6-35B-A3B-shaped Q4_0 GGUF in it (the file's header and tensor table,
    its data a hole: 17.8 GiB that take no disk) on a machine with a 12,000 MiB GPU: the list marks it with --fit's
    plan, the same one the ledger makes for that file."""
    from PySide6.QtWidgets import QFileDialog

    from app.library.marks import FITS_EXPERTS, mark_model_shape
    from engine.ledger import ModelShape
    from tests.engine.test_moe_llamacpp import make as make_moe

    controller, local, memory = library
    memory[0] = (12_000, 64_000)
    folder = tmp_path / "models"
    folder.mkdir()
    shape = make_moe.MoEShape(hidden=2048, layers=40, heads=16, kv_heads=2, head_dim=256, gdn_k_heads=16,
                              gdn_v_heads=32, gdn_head_dim=128, experts=256, experts_used=8, expert_width=512,
                              shared_width=512, context=262144)
    path = make_moe.write_moe_gguf(folder / "Qwen3.6-35B-A3B-Q4_0.gguf", shape, "Q4_0", header_only=True)
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    QTest.mouseClick(local.add_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: any(m.path == path for m in local.models) and local.marked == local.scans, 60_000)
    mark, _ = fit_cell(local, next(m.name for m in local.models if m.path == path))
    planned = mark_model_shape(ModelShape.from_path(path), vram_mib=12_000, ram_mib=64_000,
                               settings=local._settings())
    assert mark.text() == FITS_EXPERTS == planned.mark, mark.toolTip()
    assert planned.detail in mark.toolTip() and "MoE layers go to host memory" in mark.toolTip()


def test_a_moe_model_too_big_for_the_gpu_is_marked_fits_with_host_experts():
    """The mark of --fit's plan, the same placement the engine makes at load (the ledger's numbers)."""
    from app.library.marks import FITS_EXPERTS, mark_model_shape
    from engine.ledger import ModelShape
    from tests.engine.test_moe_placement import qwen36_35b_a3b

    shape = ModelShape.from_config(qwen36_35b_a3b())
    settings = {"weight_dtype": "int4", "max_context": 8192}
    whole = mark_model_shape(shape, vram_mib=48_000, ram_mib=64_000, settings=settings)
    assert whole.mark == "fits"
    mark = mark_model_shape(shape, vram_mib=12_000, ram_mib=64_000, settings=settings)
    assert mark.mark == FITS_EXPERTS and "MoE layers go to host memory" in mark.detail, mark
    assert mark_model_shape(shape, vram_mib=12_000, ram_mib=64_000, settings=dict(settings, fit=False)).mark != \
        FITS_EXPERTS


# ---- 4. with the API open to the network, the address other computers use --------------------------------------------
def test_with_lan_on_the_app_gives_out_the_address_other_computers_use(qapp, qloop, app_home, request, monkeypatch):
    from PySide6.QtGui import QGuiApplication

    from app import client as api
    from app.client import Endpoint

    monkeypatch.setattr(api, "lan_addresses", lambda: ["192.168.1.23"], raising=False)  # its address on the network
    controller = make_controller(app_home, request.node.name)
    service = FakeService(host="0.0.0.0", api_key="sk-lan")  # Server tab ▸ "Open to the network" applied
    controller.service = service
    controller.endpoint = Endpoint(service.base_url, service.api_key, local=True)  # the chat itself stays on loopback
    controller.client, controller.model_id = FakeClient(dict(CHAT)), "fake-model"
    try:
        controller.show_main()
        window = controller.window
        shared = f"http://192.168.1.23:{service.port}/v1"
        window.tabs.setCurrentWidget(window.server)
        assert f"curl {shared}/chat/completions" in window.server.curl.toPlainText()
        assert f'base_url="{shared}"' in window.server.python.toPlainText()
        QGuiApplication.clipboard().clear()
        controller.tray.copy_action.trigger()  # the tray's Copy API URL
        assert QGuiApplication.clipboard().text() == shared
        assert shared in window.status_label.text() and "0.0.0.0" not in window.status_label.text()
        assert shared in controller.tray.icon.toolTip()
        service.restart_server(host="127.0.0.1", port=0)  # back to this computer only (as the Server tab does)
        controller.state_changed.emit()
        local = f"http://127.0.0.1:{service.port}/v1"
        assert f"curl {local}/chat/completions" in window.server.curl.toPlainText() and local in \
            window.status_label.text()
        controller.tray.copy_action.trigger()
        assert QGuiApplication.clipboard().text() == local
    finally:
        controller.quitting, controller.client, controller.service = True, None, None
        service.stop()


# ---- 5. the first start's warm-up says what it does ------------------------------------------------------------------
class WarmingService:
    """A LocalService whose weights are read and which now compiles its kernels, until it is cancelled."""

    status, progress, serving, host, port, api_key = "loading", 1.0, False, "127.0.0.1", 0, None
    model_ids, model_path, load_error, switch_error = ["fake-model"], "fake-model.gguf", None, None
    url = base_url = "http://127.0.0.1:0"

    def __init__(self, settings=None):
        import threading
        from types import SimpleNamespace

        from engine.build import WARMUP

        self.finished, self.ready = threading.Event(), threading.Event()
        self.state = SimpleNamespace(loaded=None)
        self.message = WARMUP + "compiling the C++ decode kernels for this CPU (the first start only)"

    def start(self):
        return self

    def cancel(self) -> None:
        self.status, self.message = "cancelled", "cancelled"
        self.finished.set()

    def stop(self, timeout: float = 10.0) -> None:
        pass


def test_the_warm_up_says_it_compiles_the_kernels(qapp, qloop, app_home, request, monkeypatch):
    import app.controller
    from engine.build import WARMUP
    from tests.app.conftest import STARTUP_TIMEOUT_MS

    services: list[WarmingService] = []
    monkeypatch.setattr(app.controller, "LocalService", lambda settings: services.append(WarmingService()) or
                        services[-1])
    controller = make_controller(app_home, request.node.name)
    launcher = controller.launcher
    launcher.show()
    wait_until(launcher.start_button.isEnabled, STARTUP_TIMEOUT_MS)
    QTest.mouseClick(launcher.start_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: "Warming up" in launcher.status.text(), 10_000)
    assert "Warming up: compiling the C++ decode kernels for this CPU" in launcher.status.text()
    assert launcher.progress.maximum() == 0 and launcher.cancel_button.isVisible()
    services[0].message = WARMUP + "checking the converted weights"  # the next phase
    wait_until(lambda: "Warming up: checking the converted weights" in launcher.status.text(), 5000)
    QTest.mouseClick(launcher.cancel_button, Qt.MouseButton.LeftButton)
    wait_until(lambda: controller.service is None and not launcher.loading, 10_000)


def test_the_status_bar_says_warming_up_once_the_weights_of_a_switch_are_in(chat_window):
    """The main window's status bar read "Loading the model… 100%" through a switch's whole warm-up."""
    from engine.build import WARMUP

    controller, window, _ = chat_window
    service = FakeService()
    service.status, service.progress, service.message = "loading", 0.42, "loading model.layers.3.mlp"
    controller.service = service
    controller.state_changed.emit()
    wait_until(lambda: window.status_label.text() == "Loading the model… 42%", 5000)
    service.progress, service.message = 1.0, WARMUP + "sizing the KV cache and building the engine"
    controller.state_changed.emit()
    wait_until(lambda: "Warming up" in window.status_label.text(), 5000)
    assert window.status_label.text() == "Warming up: sizing the KV cache and building the engine…"
    controller.service = None
    service.stop()
