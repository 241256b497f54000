"""What the app remembers between runs (Qt-free): recent models, the last settings, the last configuration that
worked, whether the previous session ended cleanly, and the remote server last used.

A *launch configuration* is ``{"model": path or None, "preset": name/path or None, "values": {setting: value}}``:
the launcher's model picker, preset picker and form. "last" is saved when Start is pressed; "last_good" only once the
model has loaded and the API answers, so after a crash (or a configuration that fails) the launcher can offer the
last one that worked. The file is JSON, written atomically.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.userfiles import write_replacing

from app import paths

MAX_RECENT = 10


def launch_config(model: str | None, preset: str | None, values: dict[str, Any]) -> dict[str, Any]:
    return {"model": model or None, "preset": preset or None, "values": dict(values)}


def with_server(config: dict[str, Any], host: str, port: int, api_key: str | None) -> dict[str, Any]:
    """A launch configuration with the API server's address and key changed (in place; returned)."""
    values = config.setdefault("values", {})
    values.update(host=host, port=port)
    if api_key:
        values["api_key"] = api_key
    else:
        values.pop("api_key", None)
    return config


class AppConfig:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else paths.state_file()
        self.data: dict[str, Any] = {}
        self.load()

    def load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            self.data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            self.data = {}

    def save(self) -> None:
        write_replacing(self.path, json.dumps(self.data, indent=2, ensure_ascii=False))

    # ---- recent models ---------------------------------------------------------------------------------------
    @property
    def recent_models(self) -> list[str]:
        return [m for m in self.data.get("recent_models", []) if isinstance(m, str)]

    def add_recent_model(self, path: str | None) -> None:
        if not path:
            return
        recent = [path] + [m for m in self.recent_models if m != path]
        self.data["recent_models"] = recent[:MAX_RECENT]
        self.save()

    def forget_model(self, path: str) -> None:
        """A recent model that turned out broken: not offered again."""
        self.data["recent_models"] = [m for m in self.recent_models if m != path]
        self.save()

    # ---- launch configurations -------------------------------------------------------------------------------
    @property
    def last(self) -> dict[str, Any] | None:
        return self.data.get("last")

    @property
    def last_good(self) -> dict[str, Any] | None:
        return self.data.get("last_good")

    def remember_start(self, config: dict[str, Any]) -> None:
        """Start was pressed: remember the configuration and that a session is open (a crash leaves it open)."""
        self.data["last"] = config
        self.data["session_open"] = True
        self.save()

    def remember_good(self, config: dict[str, Any]) -> None:
        """The model loaded and the API answers with this configuration."""
        self.data["last_good"] = config
        self.add_recent_model(config.get("model"))  # saves

    def remember_server(self, host: str, port: int, api_key: str | None) -> None:
        """The Server tab applied a new address or key: the next start uses them (in the last configuration, and in
        the last good one, which they are now part of)."""
        for key in ("last", "last_good"):
            if isinstance(self.data.get(key), dict):
                with_server(self.data[key], host, port, api_key)
        self.save()

    def remember_failure(self, error: str) -> None:
        self.data["last_failure"] = error
        self.data["session_open"] = False
        self.save()

    def close_session(self) -> None:
        """A clean quit."""
        self.data["session_open"] = False
        self.data.pop("last_failure", None)
        self.save()

    @property
    def crashed(self) -> bool:
        """The previous session was started and never closed cleanly (killed, crashed, power cut)."""
        return bool(self.data.get("session_open"))

    @property
    def last_failure(self) -> str | None:
        return self.data.get("last_failure")

    def acknowledge_crash(self) -> None:
        self.data["session_open"] = False
        self.save()

    # ---- small things -------------------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()
