"""The launcher: live checks, Start blocked by errors and unblocked by fixes, presets, environment overrides,
non-ASCII model paths, last good configuration, --start."""
from __future__ import annotations

import os
import socket

import pytest

from tests.app.conftest import Recorder, make_controller, wait_until

TIMEOUT = 120_000


@pytest.fixture(scope="module")
def launcher(qapp, qloop, app_home):
    controller = make_controller(app_home, "launcher")
    controller.start_local = Recorder()  # these tests never load a model
    w = controller.launcher
    w.ask_preset = lambda edits, preset: "discard"  # (a preset picked over edits asks; see test_launcher_words)
    w.show()
    wait_until(lambda: w.report is not None and None in w.model_infos, timeout=TIMEOUT)
    yield w
    w.hide()


def checks(w, level="error"):
    w.revalidate()
    return [c for c in w.validation.checks if c.level == level]


def test_defaults_can_start(launcher, qtbot):
    w = launcher
    w.form.set_values({})
    w.select_model(None)
    w.env = {}
    wait_until(w.start_button.isEnabled, timeout=TIMEOUT)
    assert not checks(w)
    assert any(c.area == "memory" and c.level == "ok" for c in w.validation.checks)
    assert w.memory_bar.estimate is not None and w.memory_bar.estimate.weights > 0
    assert "weights" in w.memory_bar.legend_text() and "RAM" in w.memory_bar.rows[0][0].text()


def test_an_error_blocks_start_and_fixing_it_unblocks(launcher, qtbot):
    w = launcher
    w.form.set_value("max_context", 1024)
    w.form.set_value("kv_capacity", 128)  # smaller than the context: needs ring mode, not in this version
    wait_until(lambda: not w.start_button.isEnabled(), timeout=5000)
    errors = checks(w)
    assert any("ring mode" in c.message and "kv-capacity" in c.remedy for c in errors)
    assert "ring mode" in w.checks_label.text()
    assert "problem" in w.status.text()
    w.form.editors["kv_capacity"].reset.click()  # back to auto
    wait_until(w.start_button.isEnabled, timeout=5000)
    assert not checks(w)


def test_preset_with_unavailable_features_lists_each(launcher, qtbot):
    w = launcher
    i = w.preset_combo.findData("12gb-mtp")
    w.preset_combo.setCurrentIndex(i)
    w._preset_picked()
    wait_until(lambda: not w.start_button.isEnabled(), timeout=5000)
    text = "\n".join(c.message for c in checks(w))
    from tests.app.test_models import unavailable_flags
    errors = checks(w)
    assert errors and all(c.remedy for c in errors)  # each problem with what to do
    for flag in unavailable_flags(w.preset):  # features this build of the engine does not have yet
        assert flag in text
    settings_errors = [c for c in errors if c.area == "settings"]
    assert all("preset:12gb-mtp" in c.message for c in settings_errors)  # each names where its value came from
    if not settings_errors:  # the preset's values all run: 256K tokens are beyond the embedded model's context
        assert any(c.area == "memory" and "262144 is beyond this model's trained context" in c.message
                   for c in errors)
    assert w.form.editors["kv_window"].isVisible() or w.form.editors["kv_window"].value() == 16384
    for name in ("kv_window", "kv_retrieve", "spec", "draft_tokens", "kv_dtype", "host_kv_mib", "kv_ring",
                 "host_pageable", "kv_reuse_hostbacked", "max_shared_prefixes", "max_context", "kv_capacity"):
        w.form.editors[name].reset.click()
    w.schedule()
    remaining = [c.message for c in checks(w)]
    assert not remaining, remaining
    w.preset_combo.setCurrentIndex(0)
    w._preset_picked()


def test_environment_overrides_are_shown_and_bad_ones_block(launcher, qtbot):
    w = launcher
    w.form.set_values({})
    w.env = {"NINFER_MAX_CONCURRENCY": "3"}
    warnings = checks(w, "warning")
    assert any("NINFER_MAX_CONCURRENCY=3" in c.message and "overrides “Conversations at once”" in c.message for c in warnings)
    assert w.validation.settings.max_concurrency == 3
    assert w.start_button.isEnabled()
    w.env = {"NINFER_MAX_CONCURRENCY": "lots"}
    assert any("[env:NINFER_MAX_CONCURRENCY]" in c.message for c in checks(w))
    assert not w.start_button.isEnabled()
    w.env = {}
    w.revalidate()
    assert w.start_button.isEnabled()


def test_port_in_use_blocks_start(launcher, qtbot):
    w = launcher
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        w.form.set_value("port", s.getsockname()[1])
        assert any(c.area == "port" for c in checks(w))
        assert not w.start_button.isEnabled()
    w.form.set_value("port", 8080)


def test_non_ascii_model_path(launcher, qtbot, tmp_path):
    from engine.model.default import default_model_path
    folder = tmp_path / "模型 ünï"
    folder.mkdir()
    model = folder / "小模型.gguf"
    os.symlink(default_model_path(), model)
    w = launcher
    w.pick_model(str(model))
    assert w.model == str(model)
    wait_until(lambda: str(model) in w.model_infos, timeout=TIMEOUT)
    wait_until(w.start_button.isEnabled, timeout=5000)
    assert any(c.area == "model" and c.level == "ok" for c in w.validation.checks)
    assert str(model) in w.config.recent_models
    assert w.validation.settings.model == str(model)
    w.select_model(None)


def test_a_missing_model_is_an_error(launcher, qtbot, tmp_path):
    w = launcher
    w.select_model(str(tmp_path / "gone.gguf"))
    wait_until(lambda: str(tmp_path / "gone.gguf") in w.model_infos, timeout=TIMEOUT)
    wait_until(lambda: any(c.area == "model" for c in checks(w)), timeout=5000)
    assert not w.start_button.isEnabled()
    w.select_model(None)
    wait_until(w.start_button.isEnabled, timeout=5000)


def test_start_and_auto_start_hand_the_settings_over(launcher, qtbot):
    w = launcher
    calls = w.controller.start_local
    w.form.set_value("max_context", 2048)
    wait_until(w.start_button.isEnabled, timeout=5000)
    before = calls.calls
    w.auto_start = True  # ninfer --start
    w.revalidate()
    assert calls.calls == before + 1 and not w.auto_start
    w.loading_finished(False, "The model is broken.")  # what the controller reports when loading fails
    assert "The model is broken." in w.checks_label.text() and w.banner_box.isVisibleTo(w)
    assert not w.loading and w.start_button.isEnabled()


def test_last_good_configuration_is_offered(launcher, qtbot):
    from app.appconfig import launch_config
    w = launcher
    good = launch_config(None, None, {"max_context": 1536})
    w.config.remember_good(good)
    w.config.remember_start(launch_config(None, None, {"max_context": 4096}))  # then "crashed"
    w.load_error = None
    w.form.set_value("max_context", 4096)
    w.revalidate()
    assert w.config.crashed and w.banner_box.isVisibleTo(w) and w.banner_button.isVisibleTo(w)
    w.banner_button.click()
    assert w.form.values()["max_context"] == 1536
    assert not w.config.crashed


def test_the_last_settings_come_back(qapp, qloop, app_home):
    from app.appconfig import AppConfig, launch_config
    path = app_home / "restart.json"
    cfg = AppConfig(path)
    cfg.remember_start(launch_config(None, "cpu-default", {"max_context": 3072, "port": 9123}))
    controller = make_controller(app_home, "restart")  # the next start of the app, same files
    try:
        w = controller.launcher
        assert w.preset is not None and w.preset.name == "cpu-default"
        values = w.form.values()
        assert values["max_context"] == 3072 and values["port"] == 9123
        assert values["device"] == "cpu"  # from the preset
    finally:
        controller.launcher.hide()


def test_cancel_loading_from_the_launcher(qapp, qloop, app_home):
    from tests.app.conftest import free_port
    controller = make_controller(app_home, "cancel")
    w = controller.launcher
    try:
        w.show()
        w.form.set_value("port", free_port())
        wait_until(w.start_button.isEnabled, timeout=TIMEOUT)
        w.start_button.click()
        assert w.loading and w.cancel_button.isVisible() and not w.form.isEnabled()
        assert controller.starting  # the service is built and bound on a worker thread, not the GUI's
        w.cancel_button.click()  # before the service even exists: cancelled as soon as it does
        wait_until(lambda: controller.service is not None or not w.loading, timeout=60_000)
        service = controller.service
        wait_until(lambda: controller.service is None and not w.loading, timeout=60_000)
        assert service.status == "cancelled" and not service.serving
        wait_until(w.start_button.isEnabled, timeout=5000)
        assert w.status.text().startswith("Loading cancelled") and w.form.isEnabled()
        assert w.load_error is None and controller.window is None
    finally:
        w.hide()


def test_closing_the_launcher_with_nothing_running_quits(launcher):
    controller = launcher.controller
    calls = controller.quit_app.calls
    launcher.close()
    wait_until(lambda: controller.quit_app.calls == calls + 1, timeout=10_000)
    assert controller.quitting and not controller.config.crashed


def test_settings_tooltips_come_from_the_schema(launcher):
    from engine.config.table import SETTINGS
    w = launcher
    for s in SETTINGS:
        if s.name not in w.form.rows:
            continue
        label, editor, _ = w.form.rows[s.name]
        tip = label.toolTip()
        assert tip.startswith(s.help) and s.flag in tip and s.env in tip, s.name


def test_command_line_start_serves_without_a_click(qapp, qloop, app_home):
    """`ninfer --model PATH --preset NAME --port N --start`: the form is filled and Start happens by itself."""
    from engine.model.default import default_model_path

    from app.main import open_windows, parse
    from tests.app.conftest import free_port
    port = free_port()
    model = str(default_model_path())
    args, values, _ = parse(["--model", model, "--preset", "cpu-default", "--port", str(port), "--start",
                             "--max-context", "1024"])
    controller = make_controller(app_home, "cli")
    handed: list = []
    controller.start_local = lambda settings, cfg: handed.append((settings, cfg))
    try:
        open_windows(args, values, controller)
        w = controller.launcher
        assert w.isVisible() and w.auto_start and w.preset.name == "cpu-default"
        wait_until(lambda: handed, timeout=TIMEOUT)
        settings, cfg = handed[0]
        assert settings.port == port and settings.max_context == 1024 and settings.model == model
        assert settings.device == "cpu" and settings.source("device") == "preset:cpu-default"
        assert cfg == {"model": model, "preset": "cpu-default", "values": {"port": port, "max_context": 1024}}
        assert not w.auto_start  # once
    finally:
        controller.launcher.hide()


def test_a_start_that_fails_comes_back_to_the_launcher(qapp, qloop, app_home):
    """start_local returns at once; a port taken between the check and the start is shown with its remedy."""
    import socket as _socket

    from app.launcher.settings import defaults, settings_or_raise
    controller = make_controller(app_home, "taken")
    w = controller.launcher
    try:
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            form = defaults()
            form["port"] = s.getsockname()[1]
            w.set_loading(True)
            controller.start_local(settings_or_raise(form, None, None, env={}), None)
            assert controller.starting and controller.service is None
            wait_until(lambda: not controller.starting, timeout=60_000)
        assert controller.service is None and not w.loading
        assert "Cannot listen on" in w.load_error and "choose another port" in w.load_error
        assert "Cannot listen on" in w.checks_label.text()
    finally:
        w.hide()
