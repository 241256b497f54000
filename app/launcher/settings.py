"""The launcher's settings, Qt-free: presets (built-in and the user's), the form's values, and the effective settings
with every problem, merged exactly the way ``ninfer-serve`` merges its sources.

Merge order in the app: defaults < preset < the form < ``NINFER_*`` environment. The form only contributes the values
that differ from the preset (or default), so a problem keeps naming where its value came from (``preset:12gb-mtp``,
``app`` for the form, ``env:NINFER_PORT``). Environment variables win over the form, as they win over a config file
for ``ninfer-serve``; the launcher lists each one that does, so nothing changes silently.

The merge is ``engine.config.loading.load_settings`` itself, through its public interface: the preset is ``--preset``, the
form is a config file (``--config``, the layer between the preset and the environment; a private temporary file,
written fresh for each check) and the environment is the environment. Secret values (the API key) never go to that
file: they join the environment given to load_settings, unless the real environment sets them already.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import shutil
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# load_settings itself merges and checks (layers, coercion, availability, combinations), so the launcher and
# ninfer-serve can never disagree about what is valid.
from engine.config.loading import MAX_SETTINGS_FILE_BYTES, PRESET_DIR, ConfigError, Settings, load_settings
from engine.config.table import SETTINGS, Setting, show_value
from engine.errors import NInferError
from engine.userfiles import read_user_file

from app import paths

FORM_SOURCE = "app"
log = logging.getLogger("ninfer.app")
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}
# Shown first, open; the rest of each group is under "More".
MAIN_SETTINGS = ("port", "host", "api_key", "model_id", "device", "weight_dtype", "max_context", "kv_capacity",
                 "kv_dtype", "kv_headroom_mib", "mode", "default_max_tokens", "max_concurrency", "threads")
FORM_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.name != "model")
_PRESET_NAME = re.compile(r"^[\w][\w .-]{0,63}$", re.UNICODE)


def defaults() -> dict[str, Any]:
    return {s.name: (list(s.default) if isinstance(s.default, list) else s.default) for s in SETTINGS}


# ---------------------------------------------------------------- presets

@dataclass(frozen=True)
class Preset:
    name: str
    path: Path
    builtin: bool

    @property
    def ref(self) -> str:
        """What --preset takes: the name of a built-in preset, the path of the user's."""
        return self.name if self.builtin else str(self.path)

    @property
    def label(self) -> str:
        return self.name if self.builtin else f"{self.name} (mine)"


def presets(user_dir: Path | None = None) -> list[Preset]:
    user_dir = user_dir or paths.user_preset_dir()
    found = [Preset(p.stem, p, True) for p in sorted(PRESET_DIR.glob("*.toml"))]
    found += [Preset(p.stem, p, False) for p in sorted(user_dir.glob("*.toml"))]
    return found


def find_preset(ref: str | None, user_dir: Path | None = None) -> Preset | None:
    if not ref:
        return None
    for p in presets(user_dir):
        if ref in (p.ref, p.name, str(p.path)):
            return p
    path = Path(ref).expanduser()
    return Preset(path.stem, path, False) if path.suffix == ".toml" and path.is_file() else None


def read_preset(preset: Preset | None) -> dict[str, Any]:
    """The raw values of a preset file (setting name -> value); an unreadable file gives {} (validation says why)."""
    if preset is None:
        return {}
    try:
        data = tomllib.loads(read_user_file(preset.path, "a preset", MAX_SETTINGS_FILE_BYTES, "").decode("utf-8"))
    except (OSError, NInferError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    return {k: v for k, v in data.items() if k in BY_NAME}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def preset_text(values: Mapping[str, Any], comment: str = "") -> str:
    """TOML for a preset: top-level keys; unset (None) values are left out, secrets are never written."""
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    for s in SETTINGS:
        if s.name in values and values[s.name] is not None and not s.secret and s.name != "model":
            lines.append(f"{s.name} = {_toml_value(values[s.name])}")
    return "\n".join(lines) + "\n"


def save_user_preset(name: str, values: Mapping[str, Any], user_dir: Path | None = None) -> Preset:
    """Writes the user's preset NAME.toml (only the values that differ from the defaults). Raises ValueError for a
    bad name or one a built-in preset already has."""
    name = name.strip()
    if not _PRESET_NAME.match(name) or name in (".", ".."):
        raise ValueError("Use letters, digits, spaces, dots, dashes or underscores for the preset name.")
    if (PRESET_DIR / f"{name}.toml").exists():
        raise ValueError(f"{name!r} is a built-in preset; choose another name.")
    base = defaults()
    changed = {k: v for k, v in values.items() if k in BY_NAME and v != base.get(k)}
    path = (user_dir or paths.user_preset_dir()) / f"{name}.toml"
    path.write_text(preset_text(changed, f"NInfer preset {name!r}, saved by the desktop app."), encoding="utf-8")
    return Preset(name, path, False)


# ---------------------------------------------------------------- the form and the environment

def baseline(preset: Preset | None) -> dict[str, Any]:
    """The values the form starts from: the defaults with the preset's values over them (typed where possible)."""
    base = defaults()
    for name, raw in read_preset(preset).items():
        base[name] = raw
    return base


@dataclass(frozen=True)
class EnvOverride:
    setting: Setting
    variable: str
    raw: str


def env_overrides(env: Mapping[str, str] | None = None) -> list[EnvOverride]:
    """NINFER_* variables that are settings: each one overrides the form."""
    env = os.environ if env is None else env
    return [EnvOverride(BY_ENV[k], k, env[k]) for k in sorted(env) if k in BY_ENV]


@dataclass
class Effective:
    settings: Settings | None  # None when a problem stands
    problems: list[str]  # ConfigError.problems
    warnings: list[str]  # unknown NINFER_* variables
    overrides: list[EnvOverride]


def changed_values(form: Mapping[str, Any], preset: Preset | None) -> dict[str, Any]:
    """The form's values that differ from the preset's (or the defaults): what the user changed."""
    base = baseline(preset)
    return {k: v for k, v in form.items() if k in BY_NAME and k != "model" and v != base.get(k)}


_FORM_DIR: Path | None = None


def _form_file(values: Mapping[str, Any]) -> Path:
    """The form's values as a TOML config file only this user can read (rewritten for each check)."""
    global _FORM_DIR
    if _FORM_DIR is None or not _FORM_DIR.is_dir():
        _FORM_DIR = Path(tempfile.mkdtemp(prefix="ninfer-form-")).resolve()
        atexit.register(shutil.rmtree, _FORM_DIR, True)
    path = _FORM_DIR / "form.toml"
    lines = [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _env_warnings(env: Mapping[str, str]) -> list[str]:
    """What load_settings says about NINFER_* variables that are not settings (misspellings, with "did you mean")."""
    unknown = {k: v for k, v in env.items() if k.startswith("NINFER_") and k not in BY_ENV}
    if not unknown:
        return []
    return load_settings([], unknown)[1]


def effective(form: Mapping[str, Any], model: str | None, preset: Preset | None,
              env: Mapping[str, str] | None = None) -> Effective:
    """The settings the engine would get: defaults < preset < form changes (+ model) < environment."""
    env = os.environ if env is None else env
    values = changed_values(form, preset)
    if model:
        values["model"] = model
    run_env = {k: v for k, v in env.items() if k in BY_ENV}
    from_form: dict[str, str] = {}  # source text load_settings gives a form value -> "app"
    plain = {}
    for name, value in values.items():
        s = BY_NAME[name]
        if value is None:
            continue  # (TOML has no null: an unset value stays as the preset or default has it)
        if s.secret:
            if s.env not in run_env:
                run_env[s.env] = str(value)
                from_form[f"env:{s.env}"] = FORM_SOURCE
        else:
            plain[name] = value
    argv = ["--preset", preset.ref] if preset is not None else []
    if plain:
        path = _form_file(plain)
        argv += ["--config", str(path)]
        from_form[f"config:{path}"] = FORM_SOURCE
    try:
        settings, _ = load_settings(argv, run_env, preset_dir=PRESET_DIR)
        problems: list[str] = []
    except ConfigError as e:
        settings, problems = None, [_rename(p, from_form) for p in e.problems]
    except Exception as e:  # a defect in the settings code must not take the launcher down
        log.exception("checking the settings failed")
        settings = None
        problems = [f"[app] the settings could not be checked ({type(e).__name__}: {e}); report this as a bug, with "
                    f"the log (Logs tab or the data folder)"]
    if settings is not None:
        sources = {k: from_form.get(v, v) for k, v in settings.sources.items()}
        settings = dataclasses.replace(settings, sources=sources, config=None)
    try:
        warnings = _env_warnings(env)
    except Exception:  # (the same defect): the problem above says it
        warnings = []
    return Effective(settings, problems, warnings, env_overrides(env))


def _rename(problem: str, sources: Mapping[str, str]) -> str:
    for old, new in sources.items():
        problem = problem.replace(old, new)
    return problem


def settings_or_raise(form: Mapping[str, Any], model: str | None, preset: Preset | None,
                      env: Mapping[str, str] | None = None) -> Settings:
    eff = effective(form, model, preset, env)
    if eff.settings is None:
        raise ConfigError(eff.problems)
    return eff.settings


def shown(value: Any) -> str:
    return show_value(value)
