"""The chat and agent sampling modes, read from an editable TOML file (the user's copy wins over the shipped one)."""
from __future__ import annotations

import tomllib
from pathlib import Path

from engine.errors import NInferError

SHIPPED = Path(__file__).resolve().parent.parent / "resources" / "modes.toml"
MODES = ("chat", "agent")
RANGES = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (0, 1_000_000), "min_p": (0.0, 1.0),
          "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def user_modes_path() -> Path:
    from platformdirs import user_config_dir
    return Path(user_config_dir("ninfer")) / "modes.toml"


def modes_path() -> Path:
    user = user_modes_path()
    return user if user.is_file() else SHIPPED


def load_modes(path: Path | None = None) -> dict[str, dict[str, float | int]]:
    """{mode: {sampling key: value}}; every mode must set every key, in range, or NInferError says what to fix."""
    path = path or modes_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise NInferError(f"The sampling modes file {path} cannot be read: {e}.",
                          "Fix the file or delete your copy to use the shipped one.") from None
    problems = []
    for mode in MODES:
        table = data.get(mode)
        if not isinstance(table, dict):
            problems.append(f"[{mode}] is missing")
            continue
        for key, (low, high) in RANGES.items():
            value = table.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                problems.append(f"{mode}.{key} = {value!r} must be a number from {low:g} to {high:g}")
        problems += [f"{mode}.{key} is not a sampling setting" for key in table if key not in RANGES]
    problems += [f"[{name}] is not a mode (use chat or agent)" for name in data if name not in MODES]
    if problems:
        raise NInferError(f"The sampling modes file {path} has problems: " + "; ".join(problems) + ".",
                          "Fix the file or delete your copy to use the shipped one.")
    return {mode: {key: data[mode][key] for key in RANGES} for mode in MODES}
