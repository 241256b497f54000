"""ninfer-eval code: the sandbox reports an infinite loop, a fork bomb, a 10 GB allocation and a 1 GB write as failures
(never crashes), scrubs the environment and cuts the network where the OS allows; every bundled problem's reference
solution passes and an empty or `pass` body fails, because check(entry_point) is always appended; the check runs,
resumes and takes HumanEval-format files."""
from __future__ import annotations

import ctypes
import json
import os
import time

import pytest

from engine.tools.eval import cli, code
from engine.tools.eval.sandbox import Limits, run_program
from engine.tools.eval.stats import wilson

QUICK = Limits(timeout_s=8.0, cpu_s=2, memory_mib=512, file_mib=16)


def test_an_infinite_loop_is_stopped_and_fails():
    t0 = time.monotonic()
    out = run_program("while True:\n    pass\n", QUICK)
    assert not out.passed and out.status in ("cpu limit", "timeout")
    assert time.monotonic() - t0 < QUICK.timeout_s + 6
    sleeper = run_program("import time\ntime.sleep(60)\n", Limits(timeout_s=1.0))
    assert not sleeper.passed and sleeper.status == "timeout"


def test_a_fork_bomb_is_contained_and_fails():
    t0 = time.monotonic()
    out = run_program("import os\nwhile True:\n    os.fork()\n", QUICK)
    assert not out.passed and out.status in ("process limit", "timeout", "cpu limit")
    assert time.monotonic() - t0 < QUICK.timeout_s + 6


def test_a_huge_allocation_fails_on_the_memory_limit():
    out = run_program("data = bytearray(10 * 2**30)\n", QUICK)
    assert not out.passed and out.status == "memory limit" and "MemoryError" in out.detail


def test_a_gigabyte_write_fails_on_the_file_size_limit():
    out = run_program("with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)\n",
                      QUICK)
    assert not out.passed and out.status == "file size limit"


def test_the_environment_is_scrubbed_and_the_network_cut_where_allowed(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    probe = ("import os, socket, sys\n"
             "assert 'SECRET_TOKEN' not in os.environ, 'environment leaked'\n"
             "assert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'SANDBOX_NETWORK', 'LC_CTYPE'}, "
             "sorted(os.environ)\n"
             "if os.environ.get('SANDBOX_NETWORK') == 'none':\n"
             "    assert [n for _, n in socket.if_nameindex()] == ['lo'], socket.if_nameindex()\n"
             "assert os.getcwd() == os.environ['HOME']\n")
    out = run_program(probe, QUICK)
    assert out.passed, out.detail
    if _namespaces_allowed():
        out = run_program("import os\nassert os.environ.get('SANDBOX_NETWORK') == 'none'\n", QUICK)
        assert out.passed, "the OS allows a network namespace but the sandbox did not take one"


def _namespaces_allowed() -> bool:
    pid = os.fork()
    if pid == 0:
        flags = 0x40000000 | (0 if os.getuid() == 0 else 0x10000000)
        os._exit(0 if ctypes.CDLL(None, use_errno=True).unshare(flags) == 0 else 1)
    return os.waitpid(pid, 0)[1] == 0


def test_bundled_problems_pass_with_their_solutions_and_fail_empty():
    problems = code.load_problems(code.PROBLEMS)
    assert len(problems) >= 30 and len({p["task_id"] for p in problems}) == len(problems)
    for p in problems:
        assert "check(candidate)" in p["test"]
        good = run_program(code.program(p, p["canonical_solution"]), QUICK)
        assert good.passed, (p["task_id"], good.detail)
        for body in ("    pass\n", "", "    return None\n"):
            bad = run_program(code.program(p, body), QUICK)
            assert not bad.passed and bad.status == "failed", (p["task_id"], body)


def test_check_is_always_called():
    humaneval_style = {"task_id": "x/0", "prompt": "def inc(n):\n", "entry_point": "inc",
                       "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
    source = code.program(humaneval_style, "    pass\n")
    assert source.rstrip().endswith("check(inc)")
    assert not run_program(source, QUICK).passed
    assert run_program(code.program(humaneval_style, "    return n + 1\n\ndef other():\n    pass\n"), QUICK).passed
    assert code.cut("    return n + 1\n\nprint(inc(2))\n") == "    return n + 1\n"


class _Solver:
    """A stand-in model: the reference solution for the problems it knows, an empty body for the others."""
    calls = 0
    known: set = set()

    def __init__(self, *args, **kwargs):
        self.problems = {p["prompt"]: p for p in code.load_problems(code.PROBLEMS)}

    context_window = 100_000

    def describe(self):
        return {"weights": "stand-in"}

    def complete(self, prompt, max_tokens):
        type(self).calls += 1
        p = self.problems.get(prompt)
        return p["canonical_solution"] + "\n\ndef unrelated():\n    pass\n" if p and p["task_id"] in self.known \
            else "    pass\n"

    def count_tokens(self, text):
        return len(text) // 4

    def close(self):
        pass


def test_the_check_counts_resumes_and_reports_intervals(tmp_path, monkeypatch, capsys):
    from engine.tools.eval import target

    monkeypatch.setattr(target, "EngineTarget", _Solver)
    _Solver.known = {"NInfer/0", "NInfer/1", "NInfer/2"}
    results, out = tmp_path / "code.jsonl", tmp_path / "code.json"
    argv = ["code", "--limit", "5", "--no-progress", "--results", str(results), "--json", str(out)]
    assert cli.main(argv) == 0
    s = json.loads(out.read_text())
    assert (s["passed"], s["items"]) == (3, 5) and s["failed"] == ["NInfer/3", "NInfer/4"]
    assert s["ci95"] == pytest.approx(list(wilson(3, 5)))
    assert "3/5 (60.0%, 95% CI 23.1-88.2%)" in capsys.readouterr().out
    calls = _Solver.calls
    assert cli.main(argv) == 0 and _Solver.calls == calls  # all five from the results file


def test_a_humaneval_file_is_taken_and_a_broken_one_refused(tmp_path, monkeypatch, capsys):
    from engine.tools.eval import target

    monkeypatch.setattr(target, "EngineTarget", _Solver)
    problems = tmp_path / "he.jsonl"
    problems.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n", "entry_point": "f",
                                    "test": "def check(candidate):\n    assert candidate(2) == 4\n"}) + "\n")
    assert cli.main(["code", "--problems", str(problems), "--no-progress"]) == 0
    assert "0/1" in capsys.readouterr().out  # the stand-in answers `pass`, which must fail
    problems.write_text('{"task_id": "a", "prompt": "def f():\\n"}\n')
    assert cli.main(["code", "--problems", str(problems), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "line 1" in err and "entry_point, test" in err
