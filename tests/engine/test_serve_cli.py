"""ninfer-serve's command line: --print-config, and each startup problem's message."""
import pytest

from engine import serve


def run(capsys, argv, monkeypatch=None, env=None):
    if monkeypatch is not None:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
    code = serve.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_print_config_shows_values_and_sources(capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "x.toml"
    cfg.write_text("max_concurrency = 2\n")
    code, out, _ = run(capsys, ["--print-config", "--config", str(cfg), "--port", "9001"], monkeypatch,
                       {"NINFER_PREFILL_CHUNK": "256"})
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "9001" in lines["port"] and "flag:--port" in lines["port"]
    assert "256" in lines["prefill_chunk"] and "env:NINFER_PREFILL_CHUNK" in lines["prefill_chunk"]
    assert "2" in lines["max_concurrency"] and f"config:{cfg}" in lines["max_concurrency"]
    assert "127.0.0.1" in lines["host"] and "default" in lines["host"]


def test_missing_model_is_a_clear_error(capsys, tmp_path):
    code, _, err = run(capsys, [str(tmp_path / "nope.gguf")])
    assert code == 2
    assert "Model not found" in err and "nope.gguf" in err and ".gguf file" in err


def test_bad_flag_value_is_a_clear_error(capsys):
    code, _, err = run(capsys, ["--port", "70000", "--print-config"])
    assert code == 2
    assert "--port" in err and "70000" in err


def test_unknown_ninfer_variable_warns_with_suggestion(capsys, monkeypatch):
    code, _, err = run(capsys, ["--print-config"], monkeypatch, {"NINFER_KV_WINDOWS": "4"})
    assert code == 0
    assert "NINFER_KV_WINDOWS" in err and "NINFER_KV_WINDOW" in err.replace("NINFER_KV_WINDOWS", "")


def test_unavailable_feature_is_refused_not_ignored(capsys, monkeypatch):
    code, _, err = run(capsys, ["--print-config"], monkeypatch, {"NINFER_SPEC": "dflash2"})
    assert code == 2 and "not available in this version" in err


def test_a_window_without_retrieval_from_the_environment_is_refused_not_silent(capsys, monkeypatch):
    env = {"NINFER_KV_WINDOW": "16384", "NINFER_KV_RING": "1", "NINFER_HOST_KV_MIB": "8192"}
    code, _, err = run(capsys, ["--print-config"], monkeypatch, env)
    assert code == 2 and "--kv-retrieve 0 never attends" in err and "NINFER_KV_WINDOW" in err
    code, out, _ = run(capsys, ["--print-config"], monkeypatch, {**env, "NINFER_KV_RETRIEVE": "8192"})
    assert code == 0 and "128 pages (8192 tokens) per layer and step" in out


def test_corrupt_gguf_fails_the_server_start(capsys, tmp_path, caplog):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    from tests.api.conftest import free_port
    code, _, _ = run(capsys, [str(bad), "--port", str(free_port())])
    assert code == 1
    assert any("not a readable GGUF" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("text, stops, expected", [
    (["Hello wor", "ld!"], ["world"], ("Hello ", True)),
    (["ab", "c", "d"], ["cx"], ("abcd", False)),
    (["The answer is 4", "2."], ["42"], ("The answer is ", True)),
    (["no stop here"], [], ("no stop here", False)),
])
def test_stop_strings_cut_and_hold_back(text, stops, expected):
    from engine.server.textstream import StopStrings
    s = StopStrings(stops)
    out, stopped = "", False
    for piece in text:
        delta, stopped = s.feed(piece)
        out += delta
        if stopped:
            break
    if not stopped:
        out += s.flush()
    assert (out, stopped) == expected
