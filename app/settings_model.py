"""The launcher's settings, Qt-free: presets (built-in and the user's), the form's values, and the effective settings
with every problem, merged exactly the way ``ninfer-serve`` merges its sources.

Merge order in the app: defaults < preset < the form < ``NINFER_*`` environment. The form only contributes the values
that differ from the preset (or default), so a problem keeps naming where its value came from (``preset:12gb-mtp``,
``app`` for the form, ``env:NINFER_PORT``). Environment variables win over the form, as they win over a config file
for ``ninfer-serve``; the launcher lists each one that does, so nothing changes silently.
"""
from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# The same machinery as load_settings (layers, coercion, checks, availability, combinations), so the launcher and
# ninfer-serve can never disagree about what is valid.
from engine.config import BY_ENV, BY_NAME, PRESET_DIR, SETTINGS, ConfigError, Settings
from engine.config import _env_layer, _mapping_layer, _preset_layer, _resolve
from engine.settings_table import Setting, show_value

from app import paths

FORM_SOURCE = "app"
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
        with open(preset.path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
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


def effective(form: Mapping[str, Any], model: str | None, preset: Preset | None,
              env: Mapping[str, str] | None = None) -> Effective:
    """The settings the engine would get: defaults < preset < form changes (+ model) < environment."""
    env = os.environ if env is None else env
    problems: list[str] = []
    warnings: list[str] = []
    layers = []
    if preset is not None:
        ref = preset.name if preset.builtin else str(preset.path)
        layers.append(_preset_layer(ref, PRESET_DIR, problems))
    values = changed_values(form, preset)
    if model:
        values["model"] = model
    layers.append(_mapping_layer(values, FORM_SOURCE, problems))
    layers.append(_env_layer(env, warnings))
    resolved, sources = _resolve(layers, problems)
    settings = None if problems else Settings(**resolved, sources=sources, preset=preset.ref if preset else None)
    return Effective(settings, problems, warnings, env_overrides(env))


def settings_or_raise(form: Mapping[str, Any], model: str | None, preset: Preset | None,
                      env: Mapping[str, str] | None = None) -> Settings:
    eff = effective(form, model, preset, env)
    if eff.settings is None:
        raise ConfigError(eff.problems)
    return eff.settings


def shown(value: Any) -> str:
    return show_value(value)
