"""The app's Qt-free parts: conversation store, app config, settings merging, validation, memory estimate, markdown
rendering, SSE and /metrics parsing, and the `ninfer` command line."""
from __future__ import annotations

import socket
import sys

import pytest

from app.chat import render
from app.appconfig import AppConfig, launch_config
from app.client import Endpoint, parse_prometheus, read_metrics
from app.launcher.settings import (baseline, changed_values, defaults, effective, find_preset, preset_text, presets,
                                save_user_preset)
from app.chat.store import ConversationStore, Message
from app.launcher.validation import split_problem, validate


# ---------------------------------------------------------------- store

def test_conversations_survive_a_restart(tmp_path):
    db = tmp_path / "会话" / "c.sqlite3"  # non-ASCII folder
    store = ConversationStore(db)
    a = store.create("First", system_prompt="Be brief.")
    store.append(a.id, Message("user", "Hello ünïcode"))
    answer = store.append(a.id, Message("assistant", "Hi", reasoning="think", stats={"tokens": 2, "ttft": 0.1}))
    answer.content += " there"
    store.update(answer)
    b = store.create("Second")
    store.append(b.id, Message("user", "needle in here"))
    store.close()

    again = ConversationStore(db)
    assert [c.title for c in again.list()] == ["Second", "First"]
    first = again.get(a.id)
    assert first.system_prompt == "Be brief."
    msgs = again.messages(a.id)
    assert [(m.role, m.content) for m in msgs] == [("user", "Hello ünïcode"), ("assistant", "Hi there")]
    assert msgs[1].reasoning == "think" and msgs[1].stats == {"tokens": 2, "ttft": 0.1}
    assert [c.title for c in again.list("NEEDLE")] == ["Second"]  # searches message text, any case
    assert [c.title for c in again.list("firs")] == ["First"]  # and titles
    assert again.list("100%") == []  # LIKE wildcards are literal
    again.rename(a.id, "Renamed")
    again.truncate(a.id, 1)
    assert [m.role for m in again.messages(a.id)] == ["user"]
    again.truncate(a.id, 5)  # keeping more than there are keeps them all
    assert len(again.messages(a.id)) == 1
    again.delete(b.id)
    assert [c.title for c in again.list()] == ["Renamed"]
    assert again.messages(b.id) == []  # messages go with their conversation


def test_app_config_remembers_last_good_and_crashes(tmp_path):
    cfg = AppConfig(tmp_path / "app.json")
    good = launch_config("/models/é.gguf", "cpu-default", {"port": 9000})
    cfg.remember_start(good)
    cfg.remember_good(good)
    assert cfg.recent_models == ["/models/é.gguf"]
    bad = launch_config(None, None, {"max_context": 999999})
    cfg.remember_start(bad)  # ... and the process dies here
    again = AppConfig(tmp_path / "app.json")
    assert again.crashed and again.last == bad and again.last_good == good
    again.remember_failure("boom")
    assert not again.crashed and again.last_failure == "boom"
    again.close_session()
    assert AppConfig(tmp_path / "app.json").last_failure is None
    for i in range(15):
        again.add_recent_model(f"/m/{i}")
    assert len(again.recent_models) == 10 and again.recent_models[0] == "/m/14"


# ---------------------------------------------------------------- settings

def test_form_merges_like_ninfer_serve_and_env_wins():
    form = defaults()
    form.update(port=9001, mode="agent")
    eff = effective(form, None, None, env={"NINFER_PORT": "9100", "NINFER_MAX_CONTEXT": "2048"})
    assert eff.settings.port == 9100 and eff.settings.source("port") == "env:NINFER_PORT"
    assert eff.settings.mode == "agent" and eff.settings.source("mode") == "app"
    assert eff.settings.max_context == 2048
    assert [o.variable for o in eff.overrides] == ["NINFER_MAX_CONTEXT", "NINFER_PORT"]


def unavailable_flags(preset) -> list[str]:
    """The flags of a preset's values this build of the engine cannot run yet (the list shrinks as features land)."""
    from app.launcher.settings import BY_NAME, read_preset
    return [BY_NAME[k].flag for k, v in read_preset(preset).items() if not BY_NAME[k].available(v)]


def test_problems_name_their_source_and_block(tmp_path):
    preset = find_preset("12gb-mtp")
    form = baseline(preset)
    eff = effective(form, None, preset, env={"NINFER_KV_WINDOWS": "1", "NINFER_TOP_K": "many"})
    assert eff.settings is None
    text = "\n".join(eff.problems)
    for flag in unavailable_flags(preset):
        assert f"[preset:12gb-mtp] {flag}" in text and "not available in this version" in text
    assert "[env:NINFER_TOP_K]" in text
    assert any("NINFER_KV_WINDOWS" in w and "did you mean NINFER_KV_WINDOW" in w for w in eff.warnings)

    mine = tmp_path / "mine.toml"
    mine.write_text('top_p = 7\n', encoding="utf-8")
    preset = find_preset(str(mine))
    form = defaults()
    form.update(port=70000)
    eff = effective(form, None, preset, env={})
    assert eff.settings is None
    message, remedy = split_problem(next(p for p in eff.problems if "--top-p" in p))
    assert message.startswith(f"[preset:{mine.resolve()}] --top-p 7") and remedy
    assert split_problem("[preset:a, preset:a, env:NINFER_X] --x 1 clashes; fix it") == (
        "[preset:a, env:NINFER_X] --x 1 clashes", "Fix it.")
    message, remedy = split_problem(next(p for p in eff.problems if "--port" in p))
    assert message.startswith("[app] --port 70000") and remedy  # the form is "app", not a file name


def test_user_presets_round_trip(tmp_path):
    values = defaults()
    values.update(port=9002, model_id=["a", "b"], temperature=0.3, api_key="secret", kv_capacity="auto")
    preset = save_user_preset("mine ü", values, tmp_path)
    text = preset.path.read_text(encoding="utf-8")
    assert "secret" not in text and 'model_id = ["a", "b"]' in text and "port = 9002" in text
    assert preset in presets(tmp_path) and not preset.builtin
    assert changed_values(baseline(preset), preset) == {}
    eff = effective(baseline(preset), None, preset, env={})
    assert eff.settings.port == 9002 and eff.settings.temperature == 0.3
    assert eff.settings.source("port") == f"preset:{preset.path}"
    with pytest.raises(ValueError):
        save_user_preset("cpu-default", values, tmp_path)  # a built-in name
    with pytest.raises(ValueError):
        save_user_preset("../evil", values, tmp_path)
    assert "greedy = true" in preset_text({"greedy": True})


# ---------------------------------------------------------------- validation and memory

class _Report:
    """A CPU-only hardware report with fixed RAM."""
    device = "cpu"
    verdicts = []
    gpus = []
    nvml = "no NVIDIA GPU"
    ram_total_mib = 16384
    ram_available_mib = 8192

    def usable_gpu(self):
        return None


def test_validation_errors_and_memory_estimate():
    from app.launcher.estimate import model_info
    info = model_info(None)
    form = defaults()
    form.update(max_context=1024, max_concurrency=2, kv_capacity="auto")
    v = validate(form, None, None, _Report(), env={}, info=info, check_port=False)
    assert v.ok, v.errors
    mem = v.memory
    assert mem.weights == info.shape.stored_bytes  # low-bit GGUF weights run as stored (weight_dtype auto)
    per_token = 2 * info.config.num_layers * info.config.num_kv_heads * info.config.head_dim * 4  # fp32 K and V
    assert mem.kv_bytes_per_token == per_token and mem.kv_tokens == 2048 and mem.kv == 2048 * per_token

    form.update(kv_capacity=128)  # below max_context: needs ring mode
    v = validate(form, None, None, _Report(), env={}, info=info, check_port=False)
    assert not v.ok and any("ring mode" in c.message for c in v.errors)

    form.update(kv_capacity="auto", max_context=9000)  # beyond the model's trained context
    v = validate(form, None, None, _Report(), env={}, info=info, check_port=False)
    assert any(c.area == "memory" and "beyond this model" in c.message for c in v.errors)

    small = _Report()
    small.ram_available_mib = 2400  # after runtime, headroom and weights, too little for 8,192 tokens of KV
    form.update(max_context=8192)
    v = validate(form, None, None, small, env={}, info=info, check_port=False)
    assert any(c.area == "memory" and "--max-context 8,192 does not fit" in c.message and "--kv-dtype" in c.remedy
               for c in v.errors), v.errors


def test_validation_model_env_and_port(tmp_path):
    form = defaults()
    v = validate(form, str(tmp_path / "missing.gguf"), None, _Report(), env={})
    assert any(c.area == "model" and c.level == "error" for c in v.checks)
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    v = validate(form, str(not_a_model), None, _Report(), env={})
    assert any("neither a GGUF file" in c.message for c in v.errors)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        form.update(port=s.getsockname()[1])
        v = validate(form, None, None, _Report(), env={"NINFER_LOG_LEVEL": "debug"})
        assert any(c.area == "port" for c in v.errors)
    warnings = [c for c in v.checks if c.area == "environment"]
    assert warnings and "NINFER_LOG_LEVEL=debug" in warnings[0].message and "Unset NINFER_LOG_LEVEL" in warnings[0].remedy

    v = validate(defaults(), None, None, _Report(), env={"NINFER_API_KEY": "topsecret"}, check_port=False)
    assert all("topsecret" not in c.message for c in v.checks)  # a secret value is never shown


def test_device_cuda_without_gpu_is_an_error():
    from engine.hardware import probe
    report = probe()
    if report.device != "cpu":
        pytest.skip("this machine has a usable GPU")
    form = defaults()
    form["device"] = "cuda"
    from app.launcher.estimate import model_info
    v = validate(form, None, None, report, env={}, info=model_info(None), check_port=False)
    assert any(c.area == "hardware" and c.level == "error" and c.remedy for c in v.checks)


# ---------------------------------------------------------------- rendering and parsing

def test_markdown_rendering_escapes_and_highlights():
    t = render.LIGHT
    out = render.markdown("Hi **there** <script>x</script> `a<b`\n\n```python\ndef f():  # c\n    return 'x'\n```\n- one",
                          t)
    assert "<b>there</b>" in out and "&lt;script&gt;" in out and "<script>" not in out
    assert "a&lt;b" in out
    assert f'<span style="color:{t["keyword"]}">def</span>' in out
    assert f'color:{t["comment"]};font-style:italic">#' in out
    assert f'<span style="color:{t["string"]}">&#x27;x&#x27;</span>' in out
    assert "<li>one</li>" in out
    streaming = render.markdown("```js\nlet a = 1", t)  # an open fence while streaming is already code
    assert "<pre" in streaming and f'color:{t["keyword"]}">let' in streaming
    assert "#include" in render.highlight("#include <x>", "c", t) and "italic" not in render.highlight("#include", "c", t)
    assert render.stats_text({"tokens": 5, "ttft": 0.25, "tok_s": 12.0, "finish": "stopped"}) == \
        "5 tokens · TTFT 0.25 s · 12.0 tok/s · stopped"
    assert render.stats_text({"tokens": 1}) == "1 token" and render.stats_text({"tokens": 1234}) == "1,234 tokens"


def test_a_numbered_list_with_blank_lines_between_items_counts_on(qapp):
    """As a QTextBrowser shows it: one list numbered 1, 2, 3, not three lists of one item each (1. 1. 1.)."""
    from PySide6.QtWidgets import QTextBrowser

    view = QTextBrowser()
    view.setHtml(render.markdown("Steps:\n\n1. Boil water.\n\n2. Add tea.\n\n3. Wait.\n\nDone.", render.LIGHT))
    numbers, block = [], view.document().begin()
    while block.isValid():
        if block.textList() is not None:  # three lists of one item would number each 1
            numbers.append(block.textList().itemNumber(block) + 1)
        block = block.next()
    assert numbers == [1, 2, 3]
    assert render.markdown("- a\n\n- b", render.LIGHT).count("<ul") == 1
    assert render.markdown("- a\n\n1. b", render.LIGHT).count("<ul") == 1  # another kind: another list


def test_endpoint_and_metrics_parsing():
    e = Endpoint.parse("localhost:8080/v1/", "k")
    assert e.base_url == "http://localhost:8080" and e.api_url == "http://localhost:8080/v1"
    assert e.headers() == {"Authorization": "Bearer k"}
    text = ('# HELP x\nninfer_engine_attached 1\nninfer_kv_pages_used 3\nninfer_kv_pages_free 29\n'
            'ninfer_decode_tokens_per_second{window="lifetime"} 5\nninfer_decode_tokens_per_second{window="recent"} 7.5\n'
            'ninfer_requests_running 1\nninfer_requests_waiting 0\n')
    assert parse_prometheus(text)["ninfer_decode_tokens_per_second"][1] == ({"window": "recent"}, 7.5)
    r = read_metrics(text)
    assert r.available and r.values["decode_tps"] == 7.5 and r.values["pages_used"] == 3
    assert not read_metrics("process_cpu_seconds_total 3\n").available
    llama = read_metrics("llamacpp:kv_cache_usage_ratio 0.25\nllamacpp:predicted_tokens_seconds 40\n")
    assert llama.available and llama.values["pages_used"] == 25 and llama.values["decode_tps"] == 40


# ---------------------------------------------------------------- the ninfer command

def test_has_display():
    from app.main import has_display
    assert not has_display({}, "linux")
    assert has_display({"DISPLAY": ":0"}, "linux") and has_display({"WAYLAND_DISPLAY": "wayland-0"}, "linux")
    assert has_display({"QT_QPA_PLATFORM": "offscreen"}, "linux")
    assert not has_display({"QT_QPA_PLATFORM": "xcb"}, "linux")
    assert has_display({}, "win32")


def test_ninfer_without_display_runs_ninfer_serve(monkeypatch, capsys):
    import engine.serve
    from app import main as app_main
    seen = {}
    monkeypatch.setattr(engine.serve, "main", lambda argv: seen.setdefault("argv", argv) and 7)
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setattr(sys, "platform", "linux")
    assert app_main.main(["--model", "m.gguf", "--preset", "cpu-default", "--port", "9001", "--start",
                          "--max-context", "2048"]) == 7
    assert seen["argv"] == ["--model", "m.gguf", "--preset", "cpu-default", "--port", "9001", "--max-context", "2048"]
    assert "no display" in capsys.readouterr().err


def test_ninfer_arguments_fill_the_form():
    from app.main import parse
    args, values, _ = parse(["--model", "x.gguf", "--start", "--port", "9003", "--max-context", "4096", "--greedy"])
    assert args.model == "x.gguf" and args.start
    assert values == {"port": 9003, "max_context": "4096", "greedy": True}
    from engine.config.loading import ConfigError
    with pytest.raises(ConfigError):
        parse(["--no-such-flag"])


def test_none_refcount_guard(qapp):
    """PySide6 6.12 on Python 3.11 loses a reference to None per void call; the guard keeps the app alive."""
    from PySide6.QtWidgets import QLabel

    from app import qtcompat
    qtcompat.guard_none_refcount()
    label = QLabel()
    for _ in range(300_000):  # far beyond None's natural reference count on 3.11 (~5,000 to ~100,000)
        label.setText("x")
    assert sys.getrefcount(None) > 1000
    assert not qtcompat.guard_none_refcount()  # once per process


def test_light_and_dark_follow_the_system(qapp):
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QPalette

    from app import theme
    from app.chat.view import transcript_palette
    hints = qapp.styleHints()
    seen = []
    slot = theme.follow_system(qapp, on_change=lambda: seen.append(theme.colors()["window"]))
    try:
        hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)  # what the system sends when it switches
        assert theme.colors() is theme.DARK and seen[-1] == theme.DARK["window"]
        assert qapp.palette().color(QPalette.ColorRole.Window).name() == theme.DARK["window"]
        assert transcript_palette() is render.DARK
        hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
        assert theme.colors() is theme.LIGHT and seen[-1] == theme.LIGHT["window"]
    finally:
        hints.colorSchemeChanged.disconnect(slot)
        theme.apply(qapp, dark=False)


def test_long_code_lines_wrap_instead_of_widening_the_transcript(qapp):
    from PySide6.QtWidgets import QTextBrowser
    view = QTextBrowser()
    view.resize(600, 400)
    view.show()
    long_line = "fn f<" + "::SyntacticalTrait" * 40 + ">() {}\n    indented();"
    view.setHtml(render.markdown(f"```rust\n{long_line}\n```\nand `{'x' * 300}`", render.LIGHT))
    qapp.processEvents()
    assert view.horizontalScrollBar().maximum() == 0 and view.document().idealWidth() <= 600
    assert "    indented();" in view.toPlainText()  # indentation kept
    view.close()


def test_a_defect_in_the_settings_code_is_a_problem_not_a_crash(monkeypatch):
    import app.launcher.settings as sm

    def broken(*_args, **_kw):
        raise NameError("name '_helper' is not defined")
    monkeypatch.setattr(sm, "load_settings", broken)
    eff = effective(defaults(), None, None, env={"NINFER_PROT": "1"})
    assert eff.settings is None and eff.warnings == []
    message, remedy = split_problem(eff.problems[0])
    assert "could not be checked (NameError" in message and remedy.startswith("Report this as a bug")
    v = validate(defaults(), None, None, _Report(), env={}, check_port=False)
    assert not v.ok and any(c.area == "settings" and "could not be checked" in c.message for c in v.errors)
