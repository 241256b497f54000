"""When each model was last used: a small JSON file in the app's data folder ($NINFER_HOME/data, else the user's data
folder), keyed by the model file's real path, written when a model finishes loading. Read by the library's list."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

_LOCK = threading.Lock()


def usage_file() -> Path:
    home = os.environ.get("NINFER_HOME", "").strip()
    if home:
        return Path(home).expanduser() / "data" / "last-used.json"
    from platformdirs import user_data_dir

    return Path(user_data_dir("ninfer", appauthor=False)) / "last-used.json"


def _key(path: Path | str) -> str:
    return str(Path(path).expanduser().resolve())


def _read() -> dict[str, float]:
    try:
        data = json.loads(usage_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def record(path: Path | str, when: float | None = None) -> None:
    """Notes that the model at ``path`` was loaded now (or at ``when``). Never raises: it is a convenience."""
    with _LOCK:
        try:
            data = _read()
            data[_key(path)] = time.time() if when is None else float(when)
            target = usage_file()
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, target)
        except OSError:
            pass


def last_used(path: Path | str) -> float | None:
    """The time (seconds since the epoch) the model at ``path`` last finished loading, None when never."""
    return _read().get(_key(path))
