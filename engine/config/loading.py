"""NInfer's one settings schema: command line, environment, TOML presets and config files, merged and validated.

Every knob is a ``Setting`` in ``engine.config.table.SETTINGS``. Sources merge, later winning:
defaults < preset (``--preset``) < config file (``--config``) < environment (``NINFER_*``) < command-line flags.
Each effective value remembers where it came from. Every problem in every source is collected and raised together
as one ``ConfigError``; a value for a feature this version does not have is rejected, never silently ignored.
Standard library only.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import os
import socket
import sys
import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping

from engine.errors import NInferError
from engine.config.kv_notes import kv_note, kv_tier_problems
from engine.modes import load_modes
from engine.config.settings import Settings
from engine.config.table import ENV_ALLOWED, ENV_ALLOWED_PREFIXES, GROUPS, SETTINGS, Setting
from engine.config.table import show_value as _show
from engine.userfiles import read_user_file

__all__ = [
    "GROUPS", "SETTINGS", "Setting", "ConfigError", "Settings", "PRESET_DIR", "build_parser",
    "load_settings", "format_settings", "settings_from_mapping", "sampling_defaults", "markdown_table", "is_loopback",
]

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}
MAX_SETTINGS_FILE_BYTES = 2**20  # a settings file is a few hundred bytes
PRESET_DIR = Path(__file__).resolve().parents[2] / "resources" / "presets"
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")


class ConfigError(NInferError):
    """All the problems found in the settings; ``str()`` gives one problem per line, each with its remedy."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} problem{'' if n == 1 else 's'} with the NInfer settings:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))
        self.remedy = "Fix each setting as described (see docs/CONFIG.md) and start again."


# ---------------------------------------------------------------- values

def _use_default(s: Setting) -> str:
    return "remove it" if s.default is None else f"remove it or use {_show(s.default)}"


def _coerce(s: Setting, raw: Any) -> tuple[Any, str | None]:
    """Convert a raw value (text from env/flags, or a TOML/Python value) to the setting's type: (value, what is wrong)."""
    if isinstance(raw, str):
        raw = raw.strip()
    if s.nullable and (raw is None or raw == ""):
        return None, None
    if s.allow_auto and isinstance(raw, str) and raw.lower() == "auto":
        return "auto", None
    if s.type is list:
        items = raw if isinstance(raw, (list, tuple)) else [raw]
        if not all(isinstance(i, str) for i in items):
            return None, "must be text or a list of text"
        return [p.strip() for i in items for p in i.split(",") if p.strip()], None
    if s.type is bool:
        if isinstance(raw, bool):
            return raw, None
        if isinstance(raw, str) and raw.lower() in BOOL_WORDS:
            return BOOL_WORDS[raw.lower()], None
        return None, "is not a yes/no value (use 1/0, true/false, yes/no or on/off)"
    if s.type is int:
        whole = "is not a whole number" + (" or auto" if s.allow_auto else "")
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            return None, whole
        try:
            return int(raw), None
        except ValueError:
            return None, whole
    if s.type is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            return None, "is not a number"
        try:
            value = float(raw)
        except (ValueError, OverflowError):  # OverflowError: an int too large for a float
            return None, "is not a number"
        return (value, None) if math.isfinite(value) else (None, "must be a finite number")
    if isinstance(raw, int) and not isinstance(raw, bool) and s.aliases:
        raw = str(raw)
    if not isinstance(raw, str):
        return None, "must be text"
    if s.choices:
        raw = dict(s.aliases).get(raw.lower(), raw.lower())
    return raw, None


def _check(s: Setting, value: Any) -> str | None:
    """What is wrong with an already-typed value (choices, range, validator), or None."""
    if value is None or value == "auto" and s.allow_auto:
        return None
    if s.choices and value not in s.choices:
        close = difflib.get_close_matches(value, s.choices, 1)
        return f"must be one of {', '.join(s.choices)}" + (f" (did you mean {close[0]}?)" if close else "")
    lo, hi = s.minimum, s.maximum
    if lo is not None and (value <= lo if s.exclusive_minimum else value < lo) or hi is not None and value > hi:
        if lo is not None and hi is not None:
            return f"must be {'above' if s.exclusive_minimum else 'from'} {lo} {'up ' if s.exclusive_minimum else ''}to {hi}"
        return f"must be at least {lo}" + (" or auto" if s.allow_auto else "") if hi is None else f"must be at most {hi}"
    return s.validator(value) if s.validator else None


def _problem(s: Setting, raw: Any, source: str, what: str) -> str:
    default = _show(s.default) if s.default is not None else f"({s.default_means})" if s.default_means else ""
    default = f" to use the default {default}" if default else ""
    return f"[{source}] {s.flag} {_hidden(s, raw)}: {what}; fix it, or remove it{default}"


def _hidden(s: Setting, value: Any) -> str:
    """A value for display; a secret one (the API key) is never shown."""
    return "(hidden)" if s.secret and value is not None else _show(value)


def is_loopback(host: str) -> bool:
    """Is ``host`` (an address or name, IPv6 possibly in brackets) this computer only: 127.0.0.0/8, ::1 or localhost?"""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = _ipv4_shorthand(host)
        if address is None:
            return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def _ipv4_shorthand(host: str) -> ipaddress.IPv4Address | None:
    """An IPv4 address in a form the system's resolver takes and ipaddress does not ("127.1", "0x7f.0.0.1")."""
    if not host or any(c not in "0123456789abcdefx." for c in host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _unavailable(s: Setting, value: Any, source: str) -> str:
    return f"[{source}] {s.flag} {_show(value)}: not available in this version ({s.needs}); {_use_default(s)}"


# ---------------------------------------------------------------- sources

Layer = dict  # setting name -> (raw value, source string)


def _mapping_layer(data: Mapping[str, Any], source: str, problems: list[str]) -> Layer:
    """A TOML document or a Python dict keyed by setting name; unknown keys are problems."""
    layer: Layer = {}
    for key, raw in data.items():
        if key in BY_NAME:
            layer[key] = (raw, source)
        elif isinstance(raw, dict):
            problems.append(f"[{source}] [{key}]: sections are not used; put the keys at the top level of the file")
        else:
            close = difflib.get_close_matches(str(key).replace("-", "_"), list(BY_NAME), 1)
            hint = f"did you mean {close[0]}?" if close else "the keys are listed in docs/CONFIG.md"
            problems.append(f"[{source}] unknown key {key!r}; {hint} Fix the name or remove it")
    return layer


def _toml_layer(path: Path, source: str, problems: list[str]) -> Layer:
    try:
        data = tomllib.loads(read_user_file(path, "a settings file", MAX_SETTINGS_FILE_BYTES,
                                            "Give the path of a TOML file of settings.").decode("utf-8"))
    except FileNotFoundError:
        problems.append(f"[{source}] file not found: {path}; check the path")
        return {}
    except NInferError as e:  # a device, a pipe, a folder or an outsized file: refused before it is read
        problems.append(f"[{source}] {e}")
        return {}
    except UnicodeDecodeError as e:  # TOML is UTF-8 text by definition
        problems.append(f"[{source}] {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                        "save it as UTF-8")
        return {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        problems.append(f"[{source}] cannot read {path} ({e}); fix the file (TOML, keys = setting names)")
        return {}
    return _mapping_layer(data, source, problems)


def _preset_layer(name: str, preset_dir: Path, problems: list[str]) -> Layer:
    path = Path(name).expanduser()
    if name.endswith(".toml") or len(path.parts) > 1:
        return _toml_layer(path.resolve(), f"preset:{path.resolve()}", problems)
    path = preset_dir / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in preset_dir.glob("*.toml"))) or "none"
        problems.append(f"[flag:--preset] no preset named {name!r} (available: {known}); "
                        "use one of those or give the path to a .toml file")
        return {}
    return _toml_layer(path, f"preset:{name}", problems)


def _env_layer(env: Mapping[str, str], warnings: list[str]) -> Layer:
    layer: Layer = {}
    for key in sorted(env):
        if not key.startswith("NINFER_"):
            continue
        if key in BY_ENV:
            layer[BY_ENV[key].name] = (env[key], f"env:{key}")
        elif key not in ENV_ALLOWED and not key.startswith(ENV_ALLOWED_PREFIXES):
            close = difflib.get_close_matches(key[7:], [e[7:] for e in BY_ENV], 1)  # compare after "NINFER_"
            warnings.append(f"environment variable {key} is not a NInfer setting and is ignored"
                            + (f"; did you mean NINFER_{close[0]}?" if close else "; see docs/CONFIG.md for the names"))
    return layer


def _flag_layer(ns: argparse.Namespace, problems: list[str]) -> Layer:
    layer: Layer = {s.name: (getattr(ns, s.name), f"flag:{s.flag}") for s in SETTINGS if hasattr(ns, s.name)}
    if ns.model_path is not None:
        if "model" in layer and layer["model"][0] != ns.model_path:
            problems.append(f"[flag:--model, arg:model] the model is given twice ({layer['model'][0]} and "
                            f"{ns.model_path}); give it once")
        layer["model"] = (ns.model_path, "arg:model")
    return layer


def _resolve(layers: list[Layer], problems: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Apply the layers in order over the defaults; collect bad values, unavailable features and bad combinations."""
    values = {s.name: list(s.default) if isinstance(s.default, list) else s.default for s in SETTINGS}
    sources = {s.name: "default" for s in SETTINGS}
    for layer in layers:
        for name, (raw, source) in layer.items():
            s = BY_NAME[name]
            value, what = _coerce(s, raw)
            what = what or _check(s, value)
            if what:
                problems.append(_problem(s, raw, source, what))
            else:
                values[name], sources[name] = value, source
    for s in SETTINGS:
        if not s.available(values[s.name]):
            problems.append(_unavailable(s, values[s.name], sources[s.name]))
    problems += kv_tier_problems(values, sources)
    problems.extend(_spec_problems(values, sources))
    host = values["host"]
    if not is_loopback(host) and values["api_key"] is None and not values["insecure_no_auth"]:
        problems.append(
            f"[{sources['host']}] --host {host} exposes the API to the network without a key; set --api-key "
            f"(or NINFER_API_KEY), or pass --insecure-no-auth if this network is trusted")
    return values, sources


def _spec_problems(values: dict[str, Any], sources: dict[str, str]) -> list[str]:
    """Speculative-decoding settings that would be ignored or cannot work together."""
    spec, out = values["spec"], []
    if spec == "draft" and not values["draft_model"]:
        out.append(f"[{sources['spec']}] --spec draft needs a draft model; set --draft-model PATH (a small model "
                   f"with the same tokenizer), or use --spec ngram")
    if values["draft_model"] and spec != "draft":
        out.append(f"[{sources['draft_model']}] --draft-model is only used by --spec draft (--spec is {spec}); "
                   f"add --spec draft or drop --draft-model")
    if values["lm_head_draft"] and spec not in ("draft", "mtp"):
        out.append(f"[{sources['lm_head_draft']}] --lm-head-draft cuts a draft's output layer, but --spec {spec} "
                   f"has none; use it with --spec draft or --spec mtp, or drop it")
    if values["draft_tokens"] and spec == "none":
        out.append(f"[{sources['draft_tokens']}] --draft-tokens {values['draft_tokens']} has no effect without "
                   f"speculative decoding; add --spec ngram|draft|mtp or drop --draft-tokens")
    return out


# ---------------------------------------------------------------- command line

class _Parser(argparse.ArgumentParser):
    """Parse errors become a ConfigError (the same collected-problems path) instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError([f"[command line] {message}; run with --help to see the options"])

    def parse_known_args(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        try:
            return super().parse_known_args(*args, **kwargs)
        except argparse.ArgumentError as e:
            self.error(str(e))


def _flag_help(s: Setting) -> str:
    default = _show(s.default) + (f" = {s.default_means}" if s.default_means else "")
    return f"{s.help} [env {s.env}; default {default}]".replace("%", "%%")


def build_parser(prog: str = "ninfer-serve") -> argparse.ArgumentParser:
    """All setting flags plus --config, --preset, --print-config and the optional positional model.

    Setting flags default to argparse.SUPPRESS so the namespace holds only what was given on the command line;
    values are converted and validated by load_settings, not by argparse, so every problem is collected.
    """
    parser = _Parser(prog=prog, allow_abbrev=False, exit_on_error=False,
                     description="Serve a model behind an OpenAI-compatible API. Settings merge: defaults < --preset "
                                 "< --config < NINFER_* environment < flags. See docs/CONFIG.md.")
    parser.add_argument("model_path", nargs="?", default=None, metavar="model",
                        help="model file or folder (same as --model); omit to serve the embedded default model")
    parser.add_argument("--preset", metavar="NAME|PATH",
                        help="preset from resources/presets (e.g. cpu-default) or a path to a .toml file")
    parser.add_argument("--config", metavar="PATH", help="TOML config file; keys are the setting names")
    parser.add_argument("--print-config", action="store_true",
                        help="print every effective setting and where it came from")
    for group in GROUPS:
        arg_group = parser.add_argument_group(f"{group} settings")
        for s in (s for s in SETTINGS if s.group == group):
            kw: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": _flag_help(s)}
            if s.type is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif s.type is list:
                kw.update(action="append", metavar=s.metavar or "ID")
            else:
                kw["metavar"] = s.metavar or (
                    "{" + ",".join(s.choices) + "}" if s.choices else "PATH" if s.nullable and s.type is str
                    else {int: "N|auto" if s.allow_auto else "N", float: "X"}.get(s.type, s.name.upper()))
            arg_group.add_argument(s.flag, **kw)
    return parser


def _known_flags() -> list[str]:
    flags = ["--help", "--preset", "--config", "--print-config"]
    for s in SETTINGS:
        flags += [s.flag, "--no-" + s.flag[2:]] if s.type is bool else [s.flag]
    return flags


def _unknown_args(extras: list[str]) -> list[str]:
    problems = []
    for arg in extras:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            close = difflib.get_close_matches(flag, _known_flags(), 1)
            problems.append(f"[command line] unknown option {flag}; "
                            + (f"did you mean {close[0]}?" if close else "run with --help to see the options"))
        else:
            problems.append(f"[command line] unexpected argument {arg!r}; give at most one model path")
    return problems


# ---------------------------------------------------------------- public entry points

def load_settings(argv: list[str] | None = None, env: Mapping[str, str] | None = None, *,
                  preset_dir: Path | None = None) -> tuple[Any, list[str]]:
    """Merge defaults < preset < config file < environment < flags. Returns (settings, warnings); raises ConfigError."""
    argv = sys.argv[1:] if argv is None else list(argv)
    env = os.environ if env is None else env
    problems: list[str] = []
    warnings: list[str] = []
    ns, extras = build_parser().parse_known_args(argv)
    problems += _unknown_args(extras)
    layers: list[Layer] = []
    if ns.preset:
        layers.append(_preset_layer(ns.preset, Path(preset_dir) if preset_dir else PRESET_DIR, problems))
    if ns.config:
        path = Path(ns.config).expanduser().resolve()
        layers.append(_toml_layer(path, f"config:{path}", problems))
    layers.append(_env_layer(env, warnings))
    layers.append(_flag_layer(ns, problems))
    values, sources = _resolve(layers, problems)
    try:
        load_modes()
    except NInferError as e:
        problems.append(str(e))
    if problems:
        raise ConfigError(problems)
    return Settings(**values, sources=sources, print_config=ns.print_config, preset=ns.preset, config=ns.config), warnings


def settings_from_mapping(values: dict, source: str) -> Any:
    """Defaults with ``values`` (setting name -> value or text) applied from ``source`` (e.g. "app"); raises ConfigError."""
    problems: list[str] = []
    layer = _mapping_layer(values, source, problems)
    effective, sources = _resolve([layer], problems)
    if problems:
        raise ConfigError(problems)
    return Settings(**effective, sources=sources)


def sampling_defaults(settings: Any) -> dict[str, float | int]:
    """Default sampling for requests: the --mode preset, overridden by explicitly set values; --greedy forces temperature 0."""
    result = dict(load_modes()[settings.mode])
    for key in SAMPLING_KEYS:
        if getattr(settings, key) is not None:
            result[key] = getattr(settings, key)
    if settings.greedy:
        result["temperature"] = 0.0
    return result


def _cpu_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _note(settings: Any, s: Setting, value: Any, sampling: dict[str, Any], model_shape) -> str:
    if s.name in SAMPLING_KEYS:
        if s.name == "temperature" and settings.greedy:
            return "effective 0 (--greedy)"
        return f"effective {sampling[s.name]} (from --mode {settings.mode})" if value is None else ""
    if s.name == "threads" and value == 0:
        return f"auto: {_cpu_threads()} CPU threads"
    if s.name == "kv_reuse_hostbacked" and value:
        return kv_note(settings, s.name, model_shape)
    if s.name in ("kv_window", "kv_retrieve", "kv_ring", "host_kv_mib") and settings.kv_window:
        return kv_note(settings, s.name, model_shape)
    return s.default_means if value == s.default and s.default_means else ""


def format_settings(settings: Any, model_shape: Callable[[], Any] | None = None) -> str:
    """The --print-config table: setting, value, source and a note on derived values, aligned in columns
    (`model_shape()`: the model's ledger shape, for the notes that count its KV pages)."""
    sampling = sampling_defaults(settings)
    rows = [("setting", "value", "source", "note")]
    rows += [(s.name, _hidden(s, getattr(settings, s.name)), settings.source(s.name),
              _note(settings, s, getattr(settings, s.name), sampling, model_shape)) for s in SETTINGS]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows)


def markdown_table() -> str:
    """The settings table of docs/CONFIG.md, generated from SETTINGS (a test keeps the doc in sync)."""
    lines = ["| Setting (TOML key) | Flag | Environment | Default | Values | Available now | Help |",
             "|---|---|---|---|---|---|---|"]
    for s in SETTINGS:
        default = f"`{_show(s.default)}`" + (f" ({s.default_means})" if s.default_means else "")
        cells = [f"`{s.name}`", f"`{s.flag}`" + (" or positional" if s.positional else ""), f"`{s.env}`", default,
                 s.values_text(), s.availability(), s.help]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m engine.config.loading > table.md  (regenerates the docs/CONFIG.md table)
    print(markdown_table())
