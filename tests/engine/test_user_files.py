"""Files named on a command line are read only when they are regular files of bounded size, and written only into
folders that exist: a device, a named pipe or an outsized file is a clear error at once (never a hang, an
out-of-memory kill or a folder tree created by a typo)."""
import os
import resource
import threading
import time

import pytest

from engine.config.loading import MAX_SETTINGS_FILE_BYTES, ConfigError, load_settings
from engine.errors import NInferError
from engine.tools.eval import cli
from engine.tools.eval.results import ResultsFile
from engine.userfiles import check_write_target, read_user_file

GROWTH_BOUND = 256 * 2**20  # far below what reading /dev/zero to its end would take


def _within(seconds: float, fn):
    """fn() run in a thread that must finish in `seconds` (a FIFO opened for reading would block it forever)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = threading.Thread(target=run, daemon=True)
    start = time.perf_counter()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before < GROWTH_BOUND
    return out, time.perf_counter() - start


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "settings.toml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("flag", ["--config", "--preset"])
@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "folder", "huge"])
def test_a_settings_file_that_is_no_regular_small_file_is_refused_at_once(tmp_path, fifo, flag, target):
    path = {"/dev/zero": "/dev/zero", "fifo": str(fifo), "folder": str(tmp_path) + "/",
            "huge": str(tmp_path / "huge.toml")}[target]
    if target == "huge":
        (tmp_path / "huge.toml").write_text("# padding\n" * (MAX_SETTINGS_FILE_BYTES // 10 + 1))
    out, _ = _within(10, lambda: load_settings([flag, path], {}))
    error = out.get("error")
    assert isinstance(error, ConfigError), out
    expected = {"/dev/zero": "is a character device, not a regular file", "fifo": "is a named pipe, not a regular file",
                "folder": "is a folder, not a regular file", "huge": "is larger than 1 MiB"}[target]
    assert expected in str(error) and f"[{'config' if flag == '--config' else 'preset'}" in str(error), str(error)


def test_a_regular_settings_file_still_loads(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("port = 9123\n")
    settings, _ = load_settings(["--config", str(path)], {})
    assert settings.port == 9123


def test_a_file_that_grows_past_the_bound_while_read_is_cut_there(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * 100)
    assert read_user_file(path, "the text", 100, "") == b"x" * 100
    with pytest.raises(NInferError, match="larger than"):
        read_user_file(path, "the text", 99, "")


def test_eval_text_from_a_device_is_refused_before_the_model_loads(capsys):
    out, took = _within(30, lambda: cli.main(["kld", "--text", "/dev/zero", "--no-progress"]))
    assert out.get("value") == 1, out
    err = capsys.readouterr().err
    assert "/dev/zero is a character device, not a regular file" in err and "--text" in err, err


@pytest.mark.parametrize("flag", ["--results", "--json"])
def test_eval_output_to_a_device_or_a_missing_folder_is_refused_before_any_work(tmp_path, capsys, flag):
    assert cli.main(["count", flag, "/dev/full", "--no-progress"]) == 2
    assert "/dev/full is a character device, not a regular file" in capsys.readouterr().err
    missing = tmp_path / "no" / "such" / "folder" / "r.jsonl"
    assert cli.main(["count", flag, str(missing), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and str(missing.parent) in err, err
    assert not (tmp_path / "no").exists(), "a folder was created"


def test_a_results_file_is_read_back_and_appended_to(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsFile(path, "count", "k").add("1", {"score": 1.0})
    again = ResultsFile(path, "count", "k")
    assert again.done["1"]["score"] == 1.0
    with pytest.raises(NInferError, match="does not exist"):
        check_write_target(tmp_path / "missing" / "r.jsonl", "the results file", "Give another --results path.")
