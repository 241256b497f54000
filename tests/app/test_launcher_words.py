"""The launcher as a first-time user meets it: fields and problems in words (not flags), fixes one click away,
presets that ask before replacing edits, the wheel that scrolls instead of editing, a broken model file named as
such, the warm-up after the weights, and a window that fits 800 x 600."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QFileDialog, QSplitter

from tests.app.conftest import Recorder, clipped, make_controller, wait_until

TIMEOUT = 120_000


@pytest.fixture(scope="module")
def launcher(qapp, qloop, app_home):
    controller = make_controller(app_home, "words")
    controller.start_local = Recorder()  # these tests never load a model
    w = controller.launcher
    w.show()
    wait_until(lambda: w.report is not None and None in w.model_infos, timeout=TIMEOUT)
    yield w
    w.hide()


def wheel(widget, steps: int = 3) -> None:
    for _ in range(steps):
        pos = QPointF(widget.width() / 2, widget.height() / 2)
        event = QWheelEvent(pos, widget.mapToGlobal(pos), QPoint(0, 0), QPoint(0, -120), Qt.MouseButton.NoButton,
                            Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
        QApplication.sendEvent(widget, event)


def test_the_wheel_over_an_unfocused_spin_box_changes_nothing(launcher):
    w = launcher
    w.form.set_values({})
    spin = w.form.editors["kv_headroom_mib"].widget
    combo = w.form.editors["kv_dtype"].widget
    before = spin.value(), combo.currentIndex(), w.preset_combo.currentIndex()
    w.activateWindow()
    w.start_button.setFocus()
    for target in (spin, combo, w.preset_combo):
        wheel(target)
    assert (spin.value(), combo.currentIndex(), w.preset_combo.currentIndex()) == before
    assert spin.focusPolicy() == Qt.FocusPolicy.StrongFocus  # a click or Tab focuses it; the wheel does not
    spin.setFocus()
    wait_until(spin.hasFocus, 2000)
    wheel(spin, 1)
    assert spin.value() != before[0]  # focused, it takes the wheel as usual


def test_a_preset_over_edits_asks_first(launcher):
    w = launcher
    w.preset_combo.setCurrentIndex(0)
    w.form.set_values({})
    w.preset_ref = None
    w.form.set_value("port", 18183)
    asked = []
    w.ask_preset = lambda edits, preset: asked.append(dict(edits)) or "cancel"
    w.preset_combo.setCurrentIndex(w.preset_combo.findData("cpu-default"))
    w.preset_combo.activated.emit(w.preset_combo.currentIndex())
    assert asked == [{"port": 18183}]
    assert w.form.values()["port"] == 18183 and w.preset_combo.currentData() is None  # cancelled: as it was
    w.ask_preset = lambda edits, preset: "keep"
    w.preset_combo.setCurrentIndex(w.preset_combo.findData("cpu-default"))
    w.preset_combo.activated.emit(w.preset_combo.currentIndex())
    values = w.form.values()
    assert values["port"] == 18183 and values["device"] == "cpu"  # the preset, with the edit on top
    assert w.launch_config() == {"model": None, "preset": "cpu-default", "values": {"port": 18183}}
    w.ask_preset = lambda edits, preset: "discard"
    w.preset_combo.setCurrentIndex(0)
    w.preset_combo.activated.emit(0)
    assert w.form.values()["port"] == 8080 and w.form.values()["device"] == "auto"
    asked.clear()
    w.ask_preset = lambda edits, preset: asked.append(1) or "discard"
    w.preset_combo.setCurrentIndex(w.preset_combo.findData("cpu-default"))
    w.preset_combo.activated.emit(w.preset_combo.currentIndex())
    assert not asked  # no edits: nothing to ask
    w.preset_combo.setCurrentIndex(0)
    w.preset_combo.activated.emit(0)


def test_fields_and_problems_speak_the_forms_words(launcher):
    w = launcher
    w.form.set_values({})
    label = w.form.rows["kv_headroom_mib"][0].text()
    # memory other programs keep, on a GPU or (CPU-only) in RAM: no "GPU" in its name on a machine without one
    assert label == "Memory kept free (MiB)"
    assert w.form.rows["kv_retrieve"][0].text() == "Older context brought back (tokens)"  # tokens, not pages
    w.form.set_value("kv_window", 4096)
    wait_until(lambda: not w.start_button.isEnabled(), 5000)
    w.revalidate()
    text = w.checks_label.text()
    assert "Host KV memory (MiB)" in text and "KV window (tokens)" in text
    assert "--host-kv-mib" not in text and "--allow-lossy-window" not in text and "[app" not in text
    assert "SmolLM2-135M-Instruct" in text and "Smollm2 135M 8k" not in text  # as the model list names it
    fix = next(f for f in w.checks.fixes if f.name == "host_kv_mib")
    assert fix.value == 4096 and f'fix:{w.checks.fixes.index(fix)}' in text and fix.text in text.replace("&quot;", '"')
    w.checks_label.linkActivated.emit(f"fix:{w.checks.fixes.index(fix)}")  # the user presses the fix
    assert w.form.values()["host_kv_mib"] == 4096
    w.revalidate()
    assert not any("host_kv_mib" == f.name for f in w.checks.fixes)  # that problem is gone
    retrieve = next(f for f in w.checks.fixes if f.name == "kv_retrieve")
    w.checks_label.linkActivated.emit(f"fix:{w.checks.fixes.index(retrieve)}")
    wait_until(w.start_button.isEnabled, 10_000)  # each fix applied: nothing blocks Start
    w.form.set_values({})


def test_a_broken_gguf_is_named_and_leaves_the_recent_list(launcher, tmp_path, monkeypatch):
    w = launcher
    broken = tmp_path / "half-downloaded.gguf"
    broken.write_bytes(b"<html>not a model</html>")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(broken), ""))
    QTest.mouseClick(w.gguf_button, Qt.MouseButton.LeftButton)  # "GGUF file…", as a user picks it
    assert str(broken) in w.config.recent_models
    wait_until(lambda: str(broken) in w.model_infos, TIMEOUT)
    w.revalidate()
    text = w.checks_label.text()
    assert "half-downloaded.gguf is not a readable GGUF file" in text and "Download it again" in text
    assert "Pick a .gguf file" not in text
    assert str(broken) not in w.config.recent_models  # the next start does not offer it again
    assert w.model_combo.findData(str(broken)) >= 0  # still shown while its error is
    w.model_combo.setCurrentIndex(0)  # the user picks the embedded model in the drop-down
    assert w.model_combo.findData(str(broken)) == -1 and w.model is None


def test_after_the_weights_it_says_what_is_happening(launcher):
    w = launcher
    w.set_loading(True)
    try:
        w.loading_progress(0.5, "loading blk.3.attn_q.weight")
        assert w.progress.maximum() == 1000 and w.progress.value() == 500
        w.loading_progress(1.0, "loading output_norm.weight")
        assert "Warming up" in w.status.text() and "KV cache" in w.status.text()
        assert "output_norm" not in w.status.text()
        assert w.progress.maximum() == 0  # a busy bar, not a bar stuck at 100%
    finally:
        w.set_loading(False)
    assert w.progress.maximum() == 1000


def test_the_launcher_fits_800x600(qapp, qloop, app_home, tmp_path):
    from app.appconfig import AppConfig
    folder = tmp_path / "Downloads" / "models from the hub" / "bartowski" / "Qwen2.5-Coder-14B-Instruct-GGUF"
    folder.mkdir(parents=True)
    model = folder / "Qwen2.5-Coder-14B-Instruct-Q4_K_M-imatrix-calibrated.gguf"
    model.write_bytes(b"GGUF")
    AppConfig(app_home / "wide.json").add_recent_model(str(model))  # a long path in the list, after a download
    controller = make_controller(app_home, "wide")  # the next start
    controller.start_local = Recorder()
    w = controller.launcher
    try:
        w.show()
        w.resize(800, 600)
        wait_until(lambda: w.width() == 800 and w.height() == 600, 3000)
        assert w.minimumSizeHint().width() <= 800 and w.minimumSizeHint().height() <= 600
        assert not clipped(w), clipped(w)
    finally:
        w.hide()


def drag(handle, dx: int) -> None:
    """Drags a splitter handle ``dx`` pixels, as a user does with the mouse."""
    from PySide6.QtCore import QEvent
    from PySide6.QtGui import QMouseEvent
    start = QPointF(handle.width() / 2, handle.height() / 2)
    for kind, at, buttons in ((QEvent.Type.MouseButtonPress, start, Qt.MouseButton.LeftButton),
                              (QEvent.Type.MouseMove, start + QPointF(dx, 0), Qt.MouseButton.LeftButton),
                              (QEvent.Type.MouseButtonRelease, start + QPointF(dx, 0), Qt.MouseButton.NoButton)):
        QApplication.sendEvent(handle, QMouseEvent(kind, at, handle.mapToGlobal(at), Qt.MouseButton.LeftButton,
                                                   buttons, Qt.KeyboardModifier.NoModifier))


def test_at_800x600_every_setting_shows_without_a_horizontal_scroll_bar(qapp, qloop, app_home):
    """#39 item 14: with every setting shown, the form was wider than its scroll area beside the memory ledger (a
    horizontal scroll bar, the reset buttons beyond the viewport), and a long tensor name cut the loading line."""
    controller = make_controller(app_home, "all-settings")
    controller.start_local = Recorder()  # (Start hands the settings over; nothing loads)
    w = controller.launcher
    try:
        w.show()
        w.resize(800, 600)
        wait_until(lambda: w.report is not None and None in w.model_infos and w.memory_bar.estimate is not None,
                   TIMEOUT)
        box = w.form.show_all  # "Show all settings": clicked on its box
        QTest.mouseClick(box, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, QPoint(8, box.height() // 2))
        assert w.form.show_all.isChecked()
        split = w.findChild(QSplitter)
        scroll = split.widget(0)  # the settings' scroll area, left of the checks
        wide = scroll.width()
        drag(split.handle(1), -400)  # the user makes the settings as narrow as the splitter lets them
        for _ in range(5):
            QApplication.processEvents()
        viewport = scroll.viewport()
        assert (w.width(), w.height()) == (800, 600) and 0 < scroll.width() < wide
        bar = scroll.horizontalScrollBar()
        assert not bar.isVisible() and bar.maximum() == 0, (scroll.width(), w.form.minimumSizeHint().width())
        shown = [e for e in w.form.editors.values() if e.isVisibleTo(w)]
        assert len(shown) == len(w.form.editors)
        for editor in shown:  # each reset button lies within the viewport's width (scrolling down reaches it)
            left = editor.reset.mapTo(viewport, editor.reset.rect().topLeft()).x()
            assert 0 <= left and left + editor.reset.width() <= viewport.width(), editor.setting.name
        QTest.mouseClick(w.start_button, Qt.MouseButton.LeftButton)
        assert w.loading
        w.loading_progress(0.4, "loading model.language_model.layers.29.linear_attn.in_proj_qkvz.weight")
        for _ in range(5):
            QApplication.processEvents()
        assert w.status.wordWrap() and w.status.sizeHint().width() <= w.status.width(), w.status.text()
        assert not clipped(w), clipped(w)
    finally:
        w.hide()


def test_reopens_into_the_last_model_that_worked(qapp, qloop, app_home):
    from app.appconfig import AppConfig, launch_config
    from app.main import open_windows, parse
    good = launch_config(None, "cpu-default", {"max_context": 1536})
    config = AppConfig(app_home / "reopen.json")
    config.remember_start(good)
    config.remember_good(good)
    config.close_session()  # a clean quit last time
    handed: list = []
    controller = make_controller(app_home, "reopen")
    controller.start_local = lambda settings, cfg: handed.append(cfg)
    try:
        args, values, _ = parse([])  # plain `ninfer`
        open_windows(args, values, controller)
        w = controller.launcher
        assert w.auto_start and w.preset.name == "cpu-default" and w.form.values()["max_context"] == 1536
        wait_until(lambda: handed, TIMEOUT)  # started without a click
        assert handed[0] == good
    finally:
        controller.launcher.hide()
    config.remember_start(good)  # ... and this time it crashed: the launcher waits for the user
    again = make_controller(app_home, "reopen")
    again.start_local = lambda settings, cfg: handed.append(cfg)
    try:
        open_windows(*parse([])[:2], again)
        assert not again.launcher.auto_start and "did not shut down" in again.launcher.banner.text()
    finally:
        again.launcher.hide()
