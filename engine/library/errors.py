"""The model library's errors, and where the hub cache lies (both needed by every module of the library)."""
from __future__ import annotations

import os
from pathlib import Path

from engine.errors import NInferError


class LibraryError(NInferError):
    """A model-library operation failed: search, listing, download or resolution."""


class OfflineError(LibraryError):
    """The hub cannot be reached (HF_HUB_OFFLINE set, or no network)."""


class DownloadCancelled(LibraryError):
    """The user cancelled the download."""


class HashMismatch(LibraryError):
    """The downloaded bytes are not the ones the hub published."""


def cache_dir() -> Path:
    """The hub cache, read from the environment when called (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"
