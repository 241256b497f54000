"""Download one GGUF file from the hub into the standard Hugging Face cache (so other tools reuse it and files they
downloaded are reused here), with progress, cancellation, the published sha256 verified before the file is reported
usable, and a full disk reported clearly. The hub client writes to a temporary ``*.incomplete`` file and moves it
into place only when complete, so an interrupted, cancelled or failed download never leaves a file that looks
loadable; a connection cut mid-file is resumed from where it stopped (HTTP range requests)."""
from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.library.hub import HubFile, LibraryError, OfflineError, endpoint, offline


class DownloadCancelled(LibraryError):
    """The user cancelled the download."""


class HashMismatch(LibraryError):
    """The downloaded bytes are not the ones the hub published."""


@dataclass(frozen=True)
class DownloadProgress:
    done: int  # bytes on disk so far
    total: int  # bytes of the file (0 when unknown)
    rate: float  # bytes per second, averaged over the download so far
    eta_s: float | None  # seconds left at that rate (None when unknown)

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0


def cache_dir() -> Path:
    """The hub cache, read from the environment when called (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _progress_class(total: int, on_progress: Callable[[DownloadProgress], None] | None,
                    cancel: threading.Event | None):
    """A stand-in for the hub client's progress bar: reports bytes, rate and time left, and stops the transfer
    (raising DownloadCancelled inside the client, which then deletes its temporary file) when ``cancel`` is set."""

    class _Bar:
        def __init__(self, *_, total: int | None = None, initial: int = 0, **__):
            self.total = int(total or 0) or int(_expected)
            self.n = int(initial or 0)
            self.start, self.start_n, self.last = time.monotonic(), self.n, 0.0

        def update(self, n: int = 1) -> None:
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled("The download was cancelled.", "Start it again to resume.")
            self.n += n
            now = time.monotonic()
            if on_progress is not None and (now - self.last >= 0.1 or self.n >= self.total):
                self.last = now
                elapsed = max(now - self.start, 1e-6)
                rate = max(self.n - self.start_n, 0) / elapsed
                eta = (self.total - self.n) / rate if rate > 0 and self.total else None
                on_progress(DownloadProgress(self.n, self.total, rate, eta))

        def close(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            return False

        def set_description(self, *_, **__) -> None:
            pass

    _expected = total
    return _Bar


def sha256_of(path: Path, cancel: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled("The download was cancelled while its hash was checked.",
                                        "Start it again; the file is checked again before it is used.")
            h.update(chunk)
    return h.hexdigest()


def _remove_cached(path: Path) -> None:
    """Removes a cached file: the snapshot link and the blob it points to."""
    target = path.resolve() if path.is_symlink() else None
    path.unlink(missing_ok=True)
    if target is not None:
        target.unlink(missing_ok=True)


def _verified_marker(sha256: str) -> Path:
    """Where a verified file's record is kept: beside the hub cache (never inside it), named by the hash."""
    return cache_dir().parent / "ninfer-verified" / sha256.lower()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def is_verified(path: Path, sha256: str) -> bool:
    """True when this very file (same size and modification time) was hashed and matched before."""
    marker = _verified_marker(sha256)
    try:
        return marker.read_text(encoding="utf-8").strip() == _stamp(path)
    except OSError:
        return False


def verify(path: Path, sha256: str, cancel: threading.Event | None = None) -> None:
    """Checks the file against the published sha256; a mismatch removes it from the cache and raises HashMismatch."""
    if not sha256 or is_verified(path, sha256):
        return
    got = sha256_of(path, cancel)
    if got != sha256.lower():
        _remove_cached(path)
        raise HashMismatch(f"{path.name}: the downloaded file's sha256 is {got[:16]}..., the hub publishes "
                           f"{sha256[:16]}...; the file was removed and will not be loaded.",
                           "Download it again; if it fails again, the hub's copy or a proxy in between is at fault.")
    try:
        marker = _verified_marker(sha256)  # skip re-hashing a verified file next time
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(_stamp(path), encoding="utf-8")
    except OSError:
        pass


def _disk_full(e: OSError, f: HubFile, where: Path) -> LibraryError:
    return LibraryError(f"The disk holding {where} is full: {f.filename} ({f.size / 2**30:.2f} GiB) did not fit; "
                        f"the partial file was removed.",
                        "Free space on that disk, or point HF_HOME (or HF_HUB_CACHE) at a disk with room, and "
                        "download again.")


def download(f: HubFile, *, on_progress: Callable[[DownloadProgress], None] | None = None,
             cancel: threading.Event | None = None) -> Path:
    """Downloads (or finds in the cache) ``f`` and returns its verified local path in the hub cache."""
    from huggingface_hub import hf_hub_download

    where = cache_dir()
    kwargs = dict(repo_id=f.repo_id, filename=f.filename, revision=f.revision, cache_dir=str(where))
    if offline():
        path = cached_path(f)
        if path is None:
            raise OfflineError(f"{f.repo_id}/{f.filename} is not in the model cache ({where}) and offline mode is "
                               f"on (HF_HUB_OFFLINE).", "Unset HF_HUB_OFFLINE and download it once.")
    else:
        try:
            path = Path(hf_hub_download(**kwargs, endpoint=endpoint(),
                                        tqdm_class=_progress_class(f.size, on_progress, cancel)))
        except LibraryError:
            raise
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise _disk_full(e, f, where) from e
            from engine.library.hub import _hub_error

            raise _hub_error(e, f"download {f.repo_id}/{f.filename}") from e
        except Exception as e:  # the hub client's HTTP errors
            from engine.library.hub import _hub_error

            raise _hub_error(e, f"download {f.repo_id}/{f.filename}") from e
    verify(path, f.sha256, cancel)
    if on_progress is not None:
        on_progress(DownloadProgress(f.size, f.size, 0.0, 0.0))
    return path


def cached_path(f: HubFile) -> Path | None:
    """The file's path in the hub cache when it is there complete, else None (no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(f.repo_id, f.filename, cache_dir=str(cache_dir()), revision=f.revision)
    return Path(found) if isinstance(found, str) else None
