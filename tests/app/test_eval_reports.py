"""The evaluation reports panel (app/evals/reports.py): lists the reports ninfer-eval wrote, newest first; shows the
chosen one's table and heatmap; selects the launcher's configuration's last report; and Run starts ninfer-eval as a
process (here the code check against a stand-in OpenAI-compatible server) and shows its new report."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.evals.reports import EvalReportsPanel, list_reports
from engine.tools.eval import cli


class _EndOnly:
    """A stand-in engine for ninfer-eval: answers with the first number in the last 1,500 characters."""

    def __init__(self, *args, **kwargs):
        pass

    context_window = 100_000

    def describe(self):
        return {"weights": "stand-in"}

    def count_tokens(self, text):
        return len(text) // 4

    def complete(self, prompt, max_tokens):
        digits = [w.strip(".") for w in prompt[-1500:].split() if w.strip(".").isdigit()]
        return " " + (digits[0] if digits else "none") + "."

    def close(self):
        pass


@pytest.fixture
def reports(tmp_path, monkeypatch):
    """Two needle reports written by ninfer-eval (a stand-in engine): default settings, then --kv-dtype k8v4."""
    from engine.tools.eval import target

    monkeypatch.setattr(target, "EngineTarget", _EndOnly)
    folder = tmp_path / "eval"
    folder.mkdir()
    for i, flags in enumerate(([], ["--kv-dtype", "k8v4"])):
        assert cli.main(["needle", "--lengths", "256,2048", "--depths", "0,1", "--seeds", "1", "--no-progress",
                         *flags, "--json", str(folder / f"needle-{i}.json"),
                         "--png", str(folder / f"needle-{i}.png")]) == 0
        os.utime(folder / f"needle-{i}.json", (1_000_000 + i, 1_000_000 + i))
    (folder / "notes.json").write_text('{"unrelated": true}')
    return folder


def test_reports_are_listed_newest_first_and_shown(qtbot, reports):
    panel = EvalReportsPanel(reports)
    qtbot.addWidget(panel)
    found = panel.reports()
    assert [r.path.name for r in found] == ["needle-1.json", "needle-0.json"]  # notes.json is not a report
    assert found[0].flags == ["--kv-dtype", "k8v4"] and found[0].headline == "needle: 3/4 passed"
    panel.list.setCurrentRow(1)
    text = panel.view.toPlainText()
    assert "passed 3 of 4 prompts" in text and "2048" in text and "0/1" in text
    assert "<img" in panel.view.toHtml()


def test_the_configurations_last_report_is_selected(qtbot, reports):
    panel = EvalReportsPanel(reports)
    qtbot.addWidget(panel)
    assert panel.set_configuration(["--kv-dtype", "k8v4"]).path.name == "needle-1.json"
    assert panel.current().path.name == "needle-1.json"
    assert panel.set_configuration([]).path.name == "needle-0.json"
    assert panel.set_configuration(["--kv-dtype", "k4v4"]) is None
    assert "No report for this configuration" in panel.status.text()


def test_an_empty_folder_says_how_to_get_reports(qtbot, tmp_path):
    panel = EvalReportsPanel(tmp_path)
    qtbot.addWidget(panel)
    assert panel.list.count() == 0 and "Run check" in panel.view.toPlainText()


class _Completions(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "stand-in"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({"choices": [{"index": 0, "text": "    return n + 1\n"}]})


def test_run_starts_a_check_and_shows_its_report(qtbot, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"task_id": "t/0", "prompt": "def inc(n):\n", "entry_point": "inc",
                                    "test": "def check(candidate):\n    assert candidate(1) == 2\n"}) + "\n")
    folder = tmp_path / "eval"
    folder.mkdir()
    try:
        panel = EvalReportsPanel(folder)
        qtbot.addWidget(panel)
        panel.set_configuration(["--url", f"http://127.0.0.1:{server.server_port}"])
        panel.check.setCurrentText("code")
        panel.options.setText(f"--problems {problems}")
        with qtbot.waitSignal(panel.report_finished, timeout=180_000) as done:
            panel.run_button.click()
            assert not panel.run_button.isEnabled()
        assert panel.run_button.isEnabled()
        assert panel.current().path == list_reports(folder)[0].path and str(panel.current().path) == done.args[0]
        assert panel.current().headline == "code: 1/1 passed"
        assert "1/1 (100.0%" in panel.view.toPlainText()
        assert (folder / "results.jsonl").is_file()
    finally:
        server.shutdown()


def test_a_failed_run_says_so(qtbot, tmp_path):
    panel = EvalReportsPanel(tmp_path)
    qtbot.addWidget(panel)
    panel.options.setText("--no-such-option")
    panel.run_button.click()
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=180_000)
    assert "before writing a report" in panel.status.text()
    assert "--no-such-option" in panel.output.toPlainText()


def test_a_configuration_is_named_by_the_flags_that_give_it():
    """configuration_flags: the model and engine settings that differ from the defaults, as ninfer-serve flags that
    load back to the same values; server and sampling settings are left out (they do not change a check)."""
    from app.evals.reports import configuration_flags
    from engine.config.loading import load_settings

    given = ["--model", "m.gguf", "--kv-dtype", "k8v4", "--kv-window", "4096", "--kv-retrieve", "4096",
             "--host-kv-mib", "2048", "--prefill-cublas", "--spec", "ngram", "--port", "9001", "--temperature", "0.3"]
    settings, _ = load_settings(given, env={})
    flags = configuration_flags(settings)
    assert flags == ["--model", "m.gguf", "--kv-dtype", "k8v4", "--host-kv-mib", "2048", "--kv-window", "4096",
                     "--kv-retrieve", "4096", "--spec", "ngram", "--prefill-cublas"]
    again, _ = load_settings(flags, env={})
    for name in ("model", "kv_dtype", "host_kv_mib", "kv_window", "kv_retrieve", "spec", "prefill_cublas"):
        assert getattr(again, name) == getattr(settings, name)
    assert configuration_flags(load_settings([], env={})[0]) == []
