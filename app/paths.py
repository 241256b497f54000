"""Where the app keeps its files: settings under the user's config dir, conversations under the user's data dir.

``NINFER_HOME`` (an allowed NINFER_* variable that is not a setting) moves both under one folder: tests and portable
installs use it. Qt-free.
"""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "ninfer"
ROOT = Path(__file__).resolve().parent.parent
RESOURCES = ROOT / "resources"
ICON_PATH = RESOURCES / "icons" / "ninfer.svg"
STYLE_PATH = RESOURCES / "styles" / "app.qss"


def _home() -> Path | None:
    home = os.environ.get("NINFER_HOME", "").strip()
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    home = _home()
    path = home / "config" if home else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    home = _home()
    path = home / "data" if home else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def user_preset_dir() -> Path:
    path = config_dir() / "presets"
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_file() -> Path:
    return config_dir() / "app.json"


def conversations_db() -> Path:
    return data_dir() / "conversations.sqlite3"
