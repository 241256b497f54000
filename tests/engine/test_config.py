"""The settings schema: merge order, sources, collected problems, unavailable features, presets, docs sync."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from engine.config import loading as config
from engine.config.loading import (
    GROUPS, SETTINGS, ConfigError, Settings, build_parser, format_settings, load_settings, markdown_table,
    sampling_defaults, settings_from_mapping,
)
from engine.errors import NInferError

ROOT = Path(__file__).resolve().parents[2]
BY_NAME = {s.name: s for s in SETTINGS}


def problems_of(argv=(), env=None, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_settings(list(argv), env or {}, **kw)
    return info.value.problems


def one_problem_about(problems: list[str], needle: str) -> str:
    hits = [p for p in problems if needle in p]
    assert len(hits) == 1, (needle, problems)
    return hits[0]


# ---------------------------------------------------------------- the table itself

def test_table_is_consistent():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    for s in SETTINGS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", s.name)
        assert s.flag == "--" + s.name.replace("_", "-")
        assert s.env == "NINFER_" + s.name.upper()
        assert s.group in GROUPS
        assert s.help.endswith(".") and "\n" not in s.help
        assert s.available(s.default), s.name  # a default is always usable
        assert bool(s.needs) == (s.availability() != "yes"), s.name
    # displayed grouped, in the GROUPS order
    order = [GROUPS.index(s.group) for s in SETTINGS]
    assert order == sorted(order)


def test_defaults_load_without_model_and_every_setting_is_an_attribute():
    settings, warnings = load_settings([], {})
    assert warnings == []
    for s in SETTINGS:
        assert getattr(settings, s.name) == s.default
        assert settings.source(s.name) == "default"
    assert settings.model is None and settings.model_id == [] and settings.kv_capacity == "auto"
    with pytest.raises(KeyError):
        settings.source("kv_windows")
    # defaults are not shared between instances
    Settings().model_id.append("x")
    assert Settings().model_id == []


# ---------------------------------------------------------------- merge order

@pytest.fixture
def layered(tmp_path):
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "mine.toml").write_text("# test preset\nport = 1001\nkv_headroom_mib = 11\n")
    cfg = tmp_path / "x.toml"
    cfg.write_text("port = 1002\nmode = 'agent'\n")
    return presets, cfg


@pytest.mark.parametrize("layers, port, source", [
    ("preset config env flag", 1004, "flag:--port"),
    ("preset config env", 1003, "env:NINFER_PORT"),
    ("preset config", 1002, "config:{cfg}"),
    ("preset", 1001, "preset:mine"),
    ("", 8080, "default"),
])
def test_merge_order_and_sources(layered, layers, port, source):
    presets, cfg = layered
    argv, env = [], {}
    if "preset" in layers:
        argv += ["--preset", "mine"]
    if "config" in layers:
        argv += ["--config", str(cfg)]
    if "env" in layers:
        env["NINFER_PORT"] = "1003"
    if "flag" in layers:
        argv += ["--port", "1004"]
    settings, _ = load_settings(argv, env, preset_dir=presets)
    assert settings.port == port
    assert settings.source("port") == source.format(cfg=cfg.resolve())
    assert settings.sources["port"] == settings.source("port")
    # settings only one layer sets keep that layer's source
    if "preset" in layers:
        assert (settings.kv_headroom_mib, settings.source("kv_headroom_mib")) == (11, "preset:mine")
    if "config" in layers:
        assert (settings.mode, settings.source("mode")) == ("agent", f"config:{cfg.resolve()}")
    else:
        assert (settings.mode, settings.source("mode")) == ("chat", "default")


def test_preset_by_path_and_bool_list_merge(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text("greedy = true\nmodel_id = ['a', 'b']\n")
    settings, _ = load_settings(["--preset", str(preset)], {})
    assert settings.greedy is True and settings.model_id == ["a", "b"]
    assert settings.source("greedy") == f"preset:{preset.resolve()}"
    settings, _ = load_settings(["--preset", str(preset), "--no-greedy"], {"NINFER_MODEL_ID": "c, d"})
    assert settings.greedy is False and settings.source("greedy") == "flag:--greedy"
    assert settings.model_id == ["c", "d"] and settings.source("model_id") == "env:NINFER_MODEL_ID"
    settings, _ = load_settings(["--model-id", "x", "--model-id", "y"], {"NINFER_MODEL_ID": "c"})
    assert settings.model_id == ["x", "y"] and settings.source("model_id") == "flag:--model-id"


def test_model_positional_and_flag():
    settings, _ = load_settings(["m.gguf"], {})
    assert settings.model == "m.gguf" and settings.source("model") == "arg:model"
    settings, _ = load_settings(["--model", "m.gguf"], {"NINFER_MODEL": "other.gguf"})
    assert settings.model == "m.gguf" and settings.source("model") == "flag:--model"
    one_problem_about(problems_of(["--model", "a.gguf", "b.gguf"]), "given twice")


def test_real_cpu_default_preset_loads():
    settings, warnings = load_settings(["--preset", "cpu-default"], {})
    assert warnings == []
    expected = {"device": "cpu", "weight_dtype": "auto", "kv_dtype": "fp32", "max_concurrency": 4,
                "prefill_chunk": 512, "mode": "chat"}
    for name, value in expected.items():
        assert getattr(settings, name) == value
        assert settings.source(name) == "preset:cpu-default"
    assert settings.source("port") == "default"


def test_every_preset_file_starts_with_a_comment():
    files = sorted((ROOT / "resources" / "presets").glob("*.toml"))
    assert {f.stem for f in files} >= {"cpu-default", "12gb-mtp", "rtx3060-ternary"}
    for f in files:
        assert f.read_text().startswith("# "), f


# ---------------------------------------------------------------- print-config

def test_print_config_shows_each_setting_and_its_source(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_concurrency = 2\n")
    settings, _ = load_settings(["--print-config", "--preset", "cpu-default", "--config", str(cfg), "--port", "9001"],
                                {"NINFER_KV_HEADROOM_MIB": "512"})
    assert settings.print_config is True and settings.model is None
    text = format_settings(settings)
    lines = text.splitlines()
    assert lines[0].split() == ["setting", "value", "source", "note"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {s.name for s in SETTINGS}
    assert rows["port"][1:3] == ["9001", "flag:--port"]
    assert rows["kv_headroom_mib"][1:3] == ["512", "env:NINFER_KV_HEADROOM_MIB"]
    assert rows["max_concurrency"][1:3] == ["2", f"config:{cfg.resolve()}"]
    assert rows["device"][1:3] == ["cpu", "preset:cpu-default"]
    assert rows["host"][1:3] == ["127.0.0.1", "default"]
    # columns are aligned: every source starts at the same offset
    col = lines[0].index("source")
    assert all(line[col:].split()[0] == settings.source(line.split()[0]) for line in lines[1:])
    # derived values are explained
    assert "effective 0.7 (from --mode chat)" in text
    assert "the embedded default model" in text
    assert re.search(r"threads\s+0\s+default\s+auto: \d+ CPU threads", text)


def test_print_config_notes_greedy():
    settings, _ = load_settings(["--greedy", "--temperature", "1.1"], {})
    assert "effective 0 (--greedy)" in format_settings(settings)


def test_help_needs_no_model(capsys):
    with pytest.raises(SystemExit) as info:
        load_settings(["--help"], {})
    assert info.value.code == 0
    out = capsys.readouterr().out
    for s in SETTINGS:
        assert s.flag in out
    assert "--no-greedy" in out and "--print-config" in out and "NINFER_KV_WINDOW" in out


# ---------------------------------------------------------------- bad values

def test_bad_int_in_env():
    p = one_problem_about(problems_of(env={"NINFER_PORT": "80x"}), "env:NINFER_PORT")
    assert "--port 80x" in p and "not a whole number" in p and "8080" in p


@pytest.mark.parametrize("argv, needle", [
    (["--port", "70000"], "from 1 to 65535"),
    (["--port", "0"], "from 1 to 65535"),
    (["--prefill-chunk", "8"], "at least 16"),
    (["--kv-capacity", "10"], "at least 64 or auto"),
    (["--max-concurrency", "257"], "from 1 to 256"),
    (["--default-max-tokens", "0"], "from 1 to 2147483647"),
    (["--temperature", "2.5"], "from 0.0 to 2.0"),
    (["--top-p", "0"], "above 0.0 up to 1.0"),
    (["--top-k", "-1"], "from 0 to 2147483647"),
    (["--min-p", "1.5"], "from 0.0 to 1.0"),
    (["--presence-penalty", "-3"], "from -2.0 to 2.0"),
    (["--frequency-penalty", "nan"], "finite"),
    (["--threads", "-1"], "at least 0"),
    (["--host", ""], "must not be empty"),
])
def test_out_of_range_flags(argv, needle):
    problems = problems_of(argv)
    assert len(problems) == 1
    assert needle in problems[0] and f"[flag:{argv[0]}] {argv[0]}" in problems[0]


def test_bad_choice_in_toml(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('kv_dtype = "fp61"\n')
    p = one_problem_about(problems_of(["--config", str(cfg)]), "--kv-dtype")
    assert f"[config:{cfg.resolve()}]" in p and "must be one of auto, fp32" in p and "did you mean fp16?" in p


def test_unknown_toml_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("kv_windw = 5\n[server]\nport = 1\n")
    problems = problems_of(["--config", str(cfg)])
    assert "did you mean kv_window?" in one_problem_about(problems, "'kv_windw'")
    assert "top level" in one_problem_about(problems, "[server]")


def test_bad_toml_syntax_and_missing_files(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("port = = 1\n")
    problems = problems_of(["--config", str(cfg), "--preset", "no-such"])
    one_problem_about(problems, "cannot read")
    assert "cpu-default" in one_problem_about(problems, "no preset named 'no-such'")
    assert "file not found" in problems_of(["--config", str(tmp_path / "missing.toml")])[0]


def test_a_config_or_preset_that_is_not_utf8_is_one_problem_naming_the_file(tmp_path):
    cfg, preset = tmp_path / "latin1.toml", tmp_path / "preset.toml"
    cfg.write_bytes('mode = "chat" # caf\u00e9\n'.encode("latin-1"))
    preset.write_bytes(b"\xff\xfeport = 1\n")
    for argv, path in ((["--config", str(cfg)], cfg), (["--preset", str(preset)], preset)):
        problems = problems_of(argv)
        assert len(problems) == 1, problems
        assert str(path.resolve()) in problems[0] or str(path) in problems[0]
        assert "not UTF-8" in problems[0] and "save it as UTF-8" in problems[0] and "\n" not in problems[0]


def test_several_problems_are_reported_together(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('kv_dtype = "fp61"\nkv_windw = 5\nthreads = "many"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(["--config", str(cfg), "--port", "70000", "--spec", "dflash2"],
                      {"NINFER_PREFILL_CHUNK": "big", "NINFER_GREEDY": "maybe"})
    err = info.value
    assert isinstance(err, NInferError)
    needles = ["--kv-dtype fp61", "'kv_windw'", "--threads many", "--port 70000", "--prefill-chunk big",
               "--greedy maybe", "--spec dflash2: not available"]
    assert len(err.problems) == len(needles)
    for needle in needles:
        one_problem_about(err.problems, needle)
    lines = str(err).splitlines()
    assert lines[0] == f"{len(needles)} problems with the NInfer settings:"
    assert lines[1:] == [f"  - {p}" for p in err.problems]


def test_bad_value_is_reported_even_when_overridden():
    problems = problems_of(["--port", "9000"], {"NINFER_PORT": "abc"})
    assert len(problems) == 1 and "env:NINFER_PORT" in problems[0]


@pytest.mark.parametrize("word, value", [
    ("1", True), ("0", False), ("true", True), ("FALSE", False), ("Yes", True), ("no", False), ("ON", True),
    ("off", False),
])
def test_bool_env_words(word, value):
    settings, _ = load_settings([], {"NINFER_GREEDY": word})
    assert settings.greedy is value and settings.source("greedy") == "env:NINFER_GREEDY"


@pytest.mark.parametrize("word", ["maybe", "2", "", "y"])
def test_bad_bool_env(word):
    assert "not a yes/no value" in one_problem_about(problems_of(env={"NINFER_GREEDY": word}), "env:NINFER_GREEDY")


def test_unknown_cli_flag_is_a_collected_problem():
    problems = problems_of(["--kv-windows", "--port", "70000"])
    assert "did you mean --kv-window?" in one_problem_about(problems, "unknown option --kv-windows")
    one_problem_about(problems, "--port 70000")


def test_malformed_command_line_raises_config_error_not_exit():
    with pytest.raises(ConfigError) as info:
        load_settings(["--port"], {})
    assert "expected one argument" in str(info.value)


def test_kv_ring_env_accepts_1_and_0():
    settings, _ = load_settings([], {"NINFER_KV_RING": "0"})
    assert settings.kv_ring == "off"
    assert "--kv-ring on needs a window" in problems_of(env={"NINFER_KV_RING": "1"})[0]


# ---------------------------------------------------------------- environment warnings

def test_unknown_env_is_a_warning_with_suggestion():
    env = {"NINFER_KV_WINDOWS": "5", "NINFER_HOME": "/x", "NINFER_TEST_FOO": "1", "PATH": "/bin",
           "NINFER_LOG_LEVEL": "debug", "NINFER_ZZZZ": "1"}
    settings, warnings = load_settings([], env)
    assert settings.log_level == "debug"
    assert len(warnings) == 2
    assert "NINFER_KV_WINDOWS" in warnings[0] and "did you mean NINFER_KV_WINDOW?" in warnings[0]
    assert "NINFER_ZZZZ" in warnings[1] and "did you mean" not in warnings[1]


def test_none_means_process_argv_and_environment(monkeypatch):
    monkeypatch.setenv("NINFER_THREADS", "3")
    monkeypatch.setattr(sys, "argv", ["ninfer-serve", "--port", "9002"])
    settings, _ = load_settings()
    assert (settings.threads, settings.source("threads")) == (3, "env:NINFER_THREADS")
    assert (settings.port, settings.source("port")) == (9002, "flag:--port")


# ---------------------------------------------------------------- features not in this version

UNAVAILABLE = [  # (setting, a value this version rejects)
    ("spec", "dflash2"),
]


def test_unavailable_list_covers_every_partial_setting():
    assert {name for name, _ in UNAVAILABLE} == {s.name for s in SETTINGS if s.needs}


@pytest.mark.parametrize("name, value", UNAVAILABLE)
def test_unavailable_value_is_rejected(name, value):
    s = BY_NAME[name]
    argv = [s.flag] if value is True else [s.flag, str(value)]
    problems = problems_of(argv)
    assert len(problems) == 1
    shown = "true" if value is True else str(value)
    remedy = "remove it" if s.default is None else f"remove it or use {config._show(s.default)}"
    assert problems[0] == f"[flag:{s.flag}] {s.flag} {shown}: not available in this version ({s.needs}); {remedy}"
    # the same from the app, the environment and a config file
    with pytest.raises(ConfigError, match="not available in this version"):
        settings_from_mapping({name: value}, "app")
    env_value = "1" if value is True else str(value)
    assert f"[env:{s.env}] {s.flag} {shown}: not available" in problems_of(env={s.env: env_value})[0]
    # the default is accepted, and so is overriding the bad value with the default
    assert getattr(settings_from_mapping({name: s.default}, "app"), name) == s.default
    default_arg = "" if s.default is None else str(s.default)  # an empty path means unset
    settings, _ = load_settings([s.flag, default_arg] if s.type is not bool else [f"--no-{s.flag[2:]}"],
                                {s.env: env_value})
    assert getattr(settings, name) == s.default


@pytest.mark.parametrize("name, value", [("weight_dtype", "bf16"), ("kv_dtype", "fp16"), ("kv_dtype", "k8v4"),
                                         ("kv_dtype", "rk4v4"), ("cuda_graphs", "off"), ("cuda_graphs", "on"),
                                         ("prefill_cublas", True),
                                         ("max_shared_prefixes", 0), ("kv_ring", "off"), ("spec", "none"),
                                         ("spec", "ngram"), ("spec", "mtp")])
def test_available_non_default_values_are_accepted(name, value):
    settings = settings_from_mapping({name: value}, "app")
    assert getattr(settings, name) == value and settings.source(name) == "app"


def test_12gb_mtp_preset_fails_listing_every_unavailable_feature():
    problems = problems_of(["--preset", "12gb-mtp"])
    unavailable = [p for p in problems if "not available in this version" in p]
    assert not any(f in p for p in unavailable for f in ("--kv-window", "--kv-retrieve", "--kv-ring", "--host-kv-mib",
                                                         "--host-pageable", "--kv-reuse-hostbacked"))
    # the window it asks for does not fit its GPU KV capacity: the problem names both and the remedy
    p = one_problem_about(problems, "--kv-capacity 17920 is below what one windowed conversation holds")
    assert p.startswith("[preset:12gb-mtp] --kv-capacity") and "raise --kv-capacity to 25792" in p


def test_12gb_mtp_with_unavailable_features_overridden_still_needs_ring_mode():
    argv = ["--preset", "12gb-mtp", "--kv-dtype", "auto", "--host-kv-mib", "0", "--kv-window", "0",
            "--kv-retrieve", "0", "--kv-ring", "auto", "--no-host-pageable", "--no-kv-reuse-hostbacked",
            "--spec", "none", "--draft-tokens", "0"]
    problems = problems_of(argv)
    assert len(problems) == 1 and "ring mode" in problems[0] and "--kv-capacity 17920" in problems[0]
    settings, _ = load_settings(argv + ["--kv-capacity", "auto"], {})
    assert settings.max_context == 262144 and settings.source("max_context") == "preset:12gb-mtp"
    assert settings.source("kv_capacity") == "flag:--kv-capacity"


def test_rtx3060_ternary_preset_fails_naming_each_problem():
    problems = problems_of(["--preset", "rtx3060-ternary"])
    assert not any("--gdn-state-fp16" in p or "--prefill-cublas" in p for p in problems)  # available now
    # its window has no retrieval: refused as lossy, naming both ways out
    p = one_problem_about(problems, "--kv-window 65536 with --kv-retrieve 0")
    assert "set --kv-retrieve" in p and "--allow-lossy-window" in p


@pytest.mark.parametrize("argv, needle, remedy", [
    (["--spec", "draft"], "--spec draft needs a draft model", "set --draft-model PATH"),
    (["--draft-model", "small.gguf"], "--draft-model is only used by --spec draft (--spec is none)",
     "add --spec draft or drop --draft-model"),
    (["--spec", "ngram", "--draft-model", "small.gguf"], "--spec is ngram", "add --spec draft"),
    (["--lm-head-draft"], "--lm-head-draft cuts a draft's output layer, but --spec none has none",
     "use it with --spec draft or --spec mtp"),
    (["--spec", "ngram", "--lm-head-draft"], "--spec ngram has none", "or drop it"),
    (["--draft-tokens", "4"], "--draft-tokens 4 has no effect without speculative decoding",
     "add --spec ngram|draft|mtp"),
    (["--spec", "ngram", "--draft-tokens", "17"], "--draft-tokens 17", "must be from 0 to 16"),
    (["--spec", "dflash2"], "not available in this version", "use mtp, draft or ngram"),
])
def test_speculative_combinations_fail_loudly(argv, needle, remedy):
    problems = problems_of(argv)
    assert len(problems) == 1, problems
    assert needle in problems[0] and remedy in problems[0]


@pytest.mark.parametrize("argv", [["--spec", "ngram"], ["--spec", "ngram", "--draft-tokens", "8"],
                                  ["--spec", "mtp", "--lm-head-draft"],
                                  ["--spec", "draft", "--draft-model", "small.gguf", "--lm-head-draft"]])
def test_speculative_combinations_that_work(argv):
    settings, _ = load_settings(argv, {})
    assert settings.spec == argv[1]


def test_kv_capacity_below_max_context_is_ring_mode():
    p = problems_of(["--kv-capacity", "1000"], {"NINFER_MAX_CONTEXT": "4096"})
    assert len(p) == 1
    assert "[flag:--kv-capacity, env:NINFER_MAX_CONTEXT]" in p[0] and "needs ring mode; set --kv-window" in p[0]
    assert "raise --kv-capacity" in p[0] and "lower --max-context" in p[0]
    for argv in (["--kv-capacity", "4096", "--max-context", "4096"], ["--kv-capacity", "1000"],
                 ["--kv-capacity", "auto", "--max-context", "4096"]):
        load_settings(argv, {})


# ---------------------------------------------------------------- programmatic use

def test_settings_from_mapping():
    settings = settings_from_mapping({"port": "9005", "greedy": "yes", "model_id": ["a"]}, "app")
    assert (settings.port, settings.greedy, settings.model_id) == (9005, True, ["a"])
    assert settings.source("port") == "app" and settings.source("host") == "default"
    with pytest.raises(ConfigError) as info:
        settings_from_mapping({"prot": 1, "port": True}, "app")
    assert len(info.value.problems) == 2
    assert "did you mean port?" in one_problem_about(info.value.problems, "'prot'")
    assert "[app] --port true: is not a whole number" in one_problem_about(info.value.problems, "--port true")


def test_build_parser_has_every_flag():
    parser = build_parser("x")
    assert parser.prog == "x"
    flags = {o for a in parser._actions for o in a.option_strings}
    assert {s.flag for s in SETTINGS} | {"--config", "--preset", "--print-config"} <= flags
    assert {"--no-greedy", "--no-host-pageable"} <= flags


# ---------------------------------------------------------------- sampling

@pytest.mark.parametrize("argv, expected", [
    ([], {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0,
          "frequency_penalty": 0.0}),
    (["--mode", "agent"], {"temperature": 0.2, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.05,
                           "frequency_penalty": 0.0}),
    (["--mode", "agent", "--temperature", "1.0", "--top-p", "0.5", "--top-k", "0", "--min-p", "0.1",
      "--presence-penalty", "-1", "--frequency-penalty", "0.5"],
     {"temperature": 1.0, "top_p": 0.5, "top_k": 0, "min_p": 0.1, "presence_penalty": -1.0,
      "frequency_penalty": 0.5}),
    (["--top-k", "40"], {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "presence_penalty": 0.0,
                         "frequency_penalty": 0.0}),
    (["--greedy", "--temperature", "1.5", "--mode", "agent"],
     {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.05,
      "frequency_penalty": 0.0}),
])
def test_sampling_defaults(argv, expected):
    settings, _ = load_settings(argv, {})
    result = sampling_defaults(settings)
    assert result == expected
    assert isinstance(result["top_k"], int)


# ---------------------------------------------------------------- docs

def test_docs_table_is_generated_from_the_schema():
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    start, end = "<!-- settings-table:start -->\n", "\n<!-- settings-table:end -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == markdown_table(), "docs/CONFIG.md is out of date: regenerate it with `python -m engine.config.loading`"
    for s in SETTINGS:
        assert f"| `{s.name}` | `{s.flag}`" in table and f"`{s.env}`" in table


def test_huge_integer_for_a_float_setting_is_a_problem_not_a_crash():
    from engine.config.loading import ConfigError, settings_from_mapping
    with pytest.raises(ConfigError) as e:
        settings_from_mapping({"temperature": 10**400}, "app")
    assert "temperature" in str(e.value)



@pytest.mark.parametrize("name", ["top_k", "default_max_tokens"])
def test_token_counts_beyond_int32_are_refused_at_startup(name):
    """The settings PUT caps them at 2**31 - 1 (docs/API.md); the command line, environment and files do too."""
    problems = problems_of([f"--{name.replace('_', '-')}", str(10**30)])
    assert len(problems) == 1 and "must be from" in problems[0] and "2147483647" in problems[0]
    settings, _ = load_settings([f"--{name.replace('_', '-')}", str(2**31 - 1)], {})
    assert getattr(settings, name) == 2**31 - 1

# ---------------------------------------------------------------- KV window / host tier / ring combinations

KV_TIER_CASES = [  # (argv, env, what the one problem must say: the cause, then the remedy)
    (["--kv-capacity", "1000", "--max-context", "4096"], {}, ["below --max-context 4096", "set --kv-window",
                                                              "raise --kv-capacity to at least 4096"]),
    (["--kv-retrieve", "512"], {}, ["--kv-retrieve 512 brings older pages back into a window", "set --kv-window"]),
    ([], {"NINFER_KV_RING": "on"}, ["--kv-ring on needs a window", "set --kv-window"]),
    (["--kv-window", "4096", "--kv-retrieve", "512"], {}, ["--host-kv-mib is 0", "set --host-kv-mib",
                                                            "--kv-ring off"]),
    (["--host-kv-mib", "1024"], {}, ["used only by ring mode and by --kv-reuse-hostbacked, and --kv-window is 0",
                                     "--host-kv-mib 0"]),
    (["--host-kv-mib", "1024", "--kv-window", "4096", "--kv-ring", "off"], {},
     ["used only by ring mode and by --kv-reuse-hostbacked, and --kv-ring is off"]),
    (["--kv-window", "4096", "--kv-retrieve", "512", "--kv-ring", "off"], {},
     ["has nothing to bring back with --kv-ring off", "--kv-retrieve 0"]),
    (["--kv-reuse-hostbacked"], {}, ["--kv-reuse-hostbacked keeps evicted prefix pages in host memory",
                                     "set --host-kv-mib"]),
    (["--kv-reuse-hostbacked", "--host-kv-mib", "512", "--max-shared-prefixes", "0"], {},
     ["--max-shared-prefixes is 0", "set --max-shared-prefixes"]),
    (["--kv-window", "4096", "--host-kv-mib", "1024"], {}, ["--kv-retrieve 0 never attends", "set --kv-retrieve",
                                                            "--allow-lossy-window"]),
    ([], {"NINFER_KV_WINDOW": "4096", "NINFER_HOST_KV_MIB": "1024"}, ["[env:NINFER_KV_WINDOW, default]",
                                                                       "--allow-lossy-window"]),
    (["--host-pageable"], {}, ["--host-pageable applies to the host KV tier", "set --host-kv-mib"]),
    (["--kv-window", "4096", "--kv-retrieve", "512", "--host-kv-mib", "1024", "--spec", "mtp"], {},
     ["--spec mtp does not run on windowed KV", "use --spec ngram or --spec draft"]),
    (["--kv-window", "4096", "--kv-retrieve", "512", "--host-kv-mib", "1024", "--kv-capacity", "2048"], {},
     # 1 sink + (4096 window + 512 chunk) / 64 + 2 unaligned edges + 512 / 64 retrieved = 83 pages
     ["--kv-capacity 2048 is below what one windowed conversation holds", "sink 1", "retrieved 8",
      "raise --kv-capacity to 5312"]),
]


@pytest.mark.parametrize("argv, env, needles", KV_TIER_CASES)
def test_kv_tier_combinations_that_cannot_work_fail_with_their_remedy(argv, env, needles):
    problems = problems_of(argv, env)
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], (needle, problems[0])


@pytest.mark.parametrize("argv, env", [
    (["--kv-window", "4096", "--kv-retrieve", "512", "--host-kv-mib", "1024"], {}),
    (["--kv-window", "4096", "--host-kv-mib", "1024", "--allow-lossy-window"], {}),
    (["--kv-window", "4096", "--kv-ring", "off"], {}),
    (["--kv-window", "4096", "--kv-retrieve", "512", "--host-kv-mib", "1024", "--spec", "ngram"], {}),
    ([], {"NINFER_KV_WINDOW": "512", "NINFER_KV_RETRIEVE": "512", "NINFER_KV_RING": "1", "NINFER_HOST_KV_MIB": "64",
          "NINFER_HOST_PAGEABLE": "1"}),
    (["--kv-window", "4096", "--kv-retrieve", "512", "--host-kv-mib", "1024", "--kv-capacity", "5312",
      "--max-context", "131072"], {}),
])
def test_kv_tier_combinations_that_work_are_accepted_and_explained(argv, env):
    settings, _ = load_settings(argv, env)
    table = config.format_settings(settings)
    window_row = next(line for line in table.splitlines() if line.startswith("kv_window "))
    pages = -(-settings.kv_window // 64)
    assert f"({pages} pages)" in window_row
    retrieve_row = next(line for line in table.splitlines() if line.startswith("kv_retrieve "))
    if settings.kv_ring == "off":
        assert "the most one conversation holds" in window_row and "unused" in retrieve_row
    elif settings.kv_retrieve == 0:
        assert "LOSSY" in retrieve_row
    else:
        assert f"{-(-settings.kv_retrieve // 64)} pages" in retrieve_row and "sink 1" in window_row


def test_print_config_counts_the_host_tier_pages_for_the_model():
    """The embedded SmolLM2-135M: fp16 KV is 23,040 B a token (30 layers x 3 KV heads x 64 x 2 x 2 B), so a
    64-token page is 1.41 MiB and 256 MiB of host KV hold 182 pages = 11,648 tokens."""
    settings, _ = load_settings(["--kv-window", "512", "--kv-retrieve", "512", "--host-kv-mib", "256",
                                 "--kv-dtype", "fp16"], {})
    from engine.ledger import ModelShape

    table = config.format_settings(settings, model_shape=lambda: ModelShape.from_path(settings.model))
    row = next(line for line in table.splitlines() if line.startswith("host_kv_mib "))
    assert "182 pages of 1.41 MiB (fp16" in row and "reaches 11648 tokens" in row
