"""The resumable results file: JSON Lines, one line per finished item of a check.

Every line carries the check's name, a ``key`` naming what was measured (the configuration and the check's
parameters, hashed) and the item's ``id``. A run given the same file skips the items whose (check, key, id) is
already there, so a long run that was stopped continues where it stopped; lines of other checks or configurations
stay in the file untouched. A line cut short by a crash is ignored (and rewritten when its item runs again)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.userfiles import check_write_target, read_user_file

MAX_RESULTS_BYTES = 2**28  # ~1M result lines


def config_key(parts: dict[str, Any]) -> str:
    """A short stable hash of what was measured (settings and parameters, JSON-serialisable)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ResultsFile:
    """Items of one check under one key: ``done`` holds those already in the file, ``add`` appends one."""

    def __init__(self, path: Path | None, check: str, key: str):
        self.path, self.check, self.key = (Path(path) if path else None), check, key
        self.done: dict[str, dict] = {}
        if self.path is None:
            return
        check_write_target(self.path, "the results file", "Give another --results path.")
        if not self.path.exists():
            return
        try:
            lines = read_user_file(self.path, "the results file", MAX_RESULTS_BYTES,
                                   "Give another --results path.").decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise NInferError(f"Cannot read the results file {self.path}: {e}.",
                              "Give another --results path, or fix or delete this file.") from None
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: its item runs again
            if isinstance(row, dict) and row.get("check") == check and row.get("key") == key and "id" in row:
                self.done[str(row["id"])] = row

    def add(self, item_id: str, record: dict[str, Any]) -> dict:
        row = {"check": self.check, "key": self.key, "id": str(item_id), **record}
        self.done[str(item_id)] = row
        if self.path is not None:
            try:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
            except OSError as e:
                raise NInferError(f"Cannot write the results file {self.path}: {e}.",
                                  "Give a writable --results path.") from None
        return row
