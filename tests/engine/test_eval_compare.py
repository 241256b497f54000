"""ninfer-eval compare A B: both configurations run the chosen checks into one report (Markdown, JSON, heatmaps) with
counts, Wilson intervals, B minus A and the items answered identically; --spec ngram against --spec none on a tiny
model answers every item identically, as greedy speculative decoding must."""
from __future__ import annotations

import json

import pytest

from engine.tools.eval import cli
from engine.tools.eval.stats import difference, wilson
from tests.engine.test_eval import tiny  # noqa: F401  (the module's fixture: tiny model, perturbed copy, text)


class _WindowedReader:
    """A stand-in engine: with a KV window it sees only the last 1,500 characters of a prompt, else all of it."""

    def __init__(self, settings, *args, **kwargs):
        self.visible = 1500 if settings.kv_window else 10**9

    context_window = 100_000

    def describe(self):
        return {"visible": self.visible}

    def count_tokens(self, text):
        return len(text) // 4

    def complete(self, prompt, max_tokens):
        digits = [w.strip(".") for w in prompt[-self.visible:].split() if w.strip(".").isdigit()]
        return " " + (digits[0] if digits else "no idea") + "."

    def close(self):
        pass


def test_compare_reports_both_sides_with_intervals(tmp_path, monkeypatch, capsys):
    from engine.tools.eval import target

    monkeypatch.setattr(target, "EngineTarget", _WindowedReader)
    out = tmp_path / "report"
    rc = cli.main(["compare", "", "--kv-window 256 --host-kv-mib 64 --allow-lossy-window", "--check",
                   "needle --lengths 256,2048 --depths 0,0.5,1 --seeds 2", "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    needle = report["checks"]["needle"]
    a, b = needle["a"], needle["b"]
    assert (a["passed"], a["items"]) == (12, 12) and b["passed"] == 8  # B misses depths 0 and 0.5 at 2048
    assert needle["difference"] == pytest.approx(list(difference(12, 12, 8, 12)))
    assert needle["difference"][2] < 0  # the interval excludes "no difference"
    assert (needle["identical"], needle["compared"]) == (8, 12)
    md = (out / "report.md").read_text()
    assert md in capsys.readouterr().out
    lo, hi = wilson(8, 12)
    assert f"8/12 (66.7%, 95% CI {100 * lo:.1f}-{100 * hi:.1f}%)" in md
    assert "Identical answers: 8 of 12." in md
    assert (out / "needle-a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "needle-b.png").is_file()


def test_compare_errors_name_the_side_and_check(tmp_path, capsys):
    assert cli.main(["compare", "", "--kv-dtyp k8v4", "--check", "needle", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Configuration B" in err and "--kv-dtyp" in err
    assert cli.main(["compare", "", "", "--check", "haystack", "--out", str(tmp_path)]) == 1
    assert "does not start with a check name" in capsys.readouterr().err


def test_speculation_gives_identical_answers(tiny, tmp_path, one_thread):  # noqa: F811
    folder, _, _ = tiny
    common = f"{folder} --device cpu --max-context 512 --weight-dtype fp32"
    out = tmp_path / "spec"
    assert cli.main(["compare", f"{common} --spec none", f"{common} --spec ngram", "--check",
                     "code --limit 4 --max-tokens 24", "--out", str(out), "--no-progress"]) == 0
    code = json.loads((out / "report.json").read_text())["checks"]["code"]
    assert code["compared"] == 4 and code["identical"] == 4
    assert code["difference"][0] == 0.0
    assert code["a"]["target"]["model"] == code["b"]["target"]["model"]
