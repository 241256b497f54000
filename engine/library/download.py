"""Download one GGUF file from the hub into the standard Hugging Face cache (so other tools reuse it and files they
downloaded are reused here), with progress (bytes, rate, time left), cancellation, the published sha256 verified
before the file is reported usable, and a full disk reported clearly. The bytes go to a partial file that only gets
its final name once complete and verified (engine/library/transfer.py), so a partial or corrupt file never loads,
and a download stopped by a cancel, a lost connection or a restart continues from where it stopped."""
from __future__ import annotations

import errno
import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.library.errors import DownloadCancelled, HashMismatch, LibraryError, OfflineError, cache_dir
from engine.library.hub import HubFile, endpoint, offline


@dataclass(frozen=True)
class DownloadProgress:
    done: int  # bytes on disk so far
    total: int  # bytes of the file (0 when unknown)
    rate: float  # bytes per second, averaged over the download so far
    eta_s: float | None  # seconds left at that rate (None when unknown)

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0


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
    _record(path, sha256)


def _record(path: Path, sha256: str) -> None:
    """Remembers that this file matched ``sha256``, so it is not hashed again."""
    try:
        marker = _verified_marker(sha256)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(_stamp(path), encoding="utf-8")
    except OSError:
        pass


def _disk_full(e: OSError, f: HubFile, where: Path) -> LibraryError:
    return LibraryError(f"The disk holding {where} is full: {f.filename} ({f.size / 2**30:.2f} GiB) did not fit; "
                        f"the partial file was removed.",
                        "Free space on that disk, or point HF_HOME (or HF_HUB_CACHE) at a disk with room, and "
                        "download again.")


def _storage(f: HubFile) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / repo_folder_name(repo_id=f.repo_id, repo_type="model")


def download(f: HubFile, *, on_progress: Callable[[DownloadProgress], None] | None = None,
             cancel: threading.Event | None = None) -> Path:
    """Downloads (or finds in the cache) ``f`` and returns its verified local path in the hub cache. A download
    stopped before the end (cancel, a lost connection, a restart) continues from its partial file next time. A split
    model (``f.parts``) downloads every part and returns the single file they are merged into."""
    if f.parts:
        return _download_parts(f, on_progress, cancel)
    if offline():
        path = cached_path(f)
        if path is None:
            raise OfflineError(f"{f.repo_id}/{f.filename} is not in the model cache ({cache_dir()}) and offline mode is "
                               f"on (HF_HUB_OFFLINE).", "Unset HF_HUB_OFFLINE and download it once.")
        verify(path, f.sha256, cancel)
        return path
    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.utils import WeakFileLock

    from engine.library import transfer
    from engine.library.hub import _guard, _hub_error, auth_headers, file_url
    from engine.library.token import load_token

    url = file_url(f)
    _guard(f"download {f.repo_id}/{f.filename}")
    try:
        meta = get_hf_file_metadata(url, token=load_token(), endpoint=endpoint())
    except Exception as e:  # the hub client's HTTP errors, each named by _hub_error
        raise _hub_error(e, f"download {f.repo_id}/{f.filename}") from e
    if not meta.etag or not meta.commit_hash:
        raise LibraryError(f"The hub gave no version for {f.repo_id}/{f.filename}.",
                           "Try again later; if it persists, check HF_ENDPOINT.")
    etag, size = meta.etag, int(meta.size or f.size)
    unsafe = transfer.unsafe_name(etag, meta.commit_hash, f.revision, f.filename)
    if unsafe is not None:  # checked before anything is created in the cache
        raise LibraryError(f"The hub answered {f.repo_id}/{f.filename} with an unsafe {unsafe}; nothing was "
                           f"written.", "Check HF_ENDPOINT: a hub or proxy that sends such names is not to be "
                           "trusted.")
    storage = _storage(f)
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    lock = cache_dir() / ".locks" / storage.name / f"{etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    bar = _Rate(size, on_progress)
    with WeakFileLock(lock):
        blob = storage / "blobs" / etag
        partial = None if blob.exists() else blob.with_name(etag + ".incomplete")
        if partial is not None:
            try:
                transfer.transfer(meta.location or url, auth_headers(), partial, size, f.sha256, bar.report,
                                  cancel)
            except transfer._Cancelled:
                raise DownloadCancelled(f"The download of {f.filename} was cancelled.",
                                        "Download it again to continue from where it stopped.") from None
            except transfer._Mismatch as e:
                raise HashMismatch(f"{f.filename}: the downloaded file's sha256 is {e.got[:16]}..., the hub publishes "
                                   f"{f.sha256[:16]}...; the file was removed and will not be loaded.",
                                   "Download it again; if it fails again, the hub's copy or a proxy in between is "
                                   "at fault.") from None
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise _disk_full(e, f, cache_dir()) from e
                raise LibraryError(f"Cannot write {f.filename} into {storage}: {e}.",
                                   "Check that the folder is writable, or point HF_HOME at one that is.") from e
            except Exception as e:  # the HTTP client's errors, each named by _hub_error
                if isinstance(e, transfer.Stalled) or type(e).__name__ == "ReadTimeout":
                    raise LibraryError(f"The hub stopped sending {f.filename} ({stall_words(e)}), {transfer.RETRIES} "
                                       f"times in a row.", "Try again later: the download continues from the part "
                                       "already on disk.") from e
                raise _hub_error(e, f"download {f.repo_id}/{f.filename}") from e
        path = transfer.place(storage, etag, meta.commit_hash, f.revision, f.filename, partial)
        if partial is not None and f.sha256:
            _record(path, f.sha256)  # transfer() hashed it before giving it its name
    verify(path, f.sha256, cancel)  # a blob found in the cache (another tool's) is checked too, once
    if on_progress is not None:
        on_progress(DownloadProgress(size, size, bar.rate, 0.0))
    return path


def stall_words(e: Exception) -> str:
    from engine.library import http, transfer

    return str(e) if isinstance(e, transfer.Stalled) else f"no byte for {http.READ_S:g} s"


def _download_parts(f: HubFile, on_progress: Callable[[DownloadProgress], None] | None,
                    cancel: threading.Event | None) -> Path:
    from engine.library.split import ensure_merged

    paths, before = [], 0
    for part in f.parts:
        def report(p: DownloadProgress, base: int = before) -> None:
            if on_progress is not None:
                left = f.size - base - p.done
                on_progress(DownloadProgress(base + p.done, f.size, p.rate, left / p.rate if p.rate > 0 else None))

        paths.append(download(part, on_progress=report, cancel=cancel))
        before += part.size
    return ensure_merged(paths[0], cancel)


class _Rate:
    """Turns (done, total) into DownloadProgress with the rate and time left, at most ten reports a second."""

    def __init__(self, total: int, on_progress: Callable[[DownloadProgress], None] | None):
        self.total, self.on_progress = total, on_progress
        self.start, self.first, self.last, self.rate = time.monotonic(), None, 0.0, 0.0

    def report(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first, self.start = done, now  # bytes already there (a resumed download) are not this rate's
        self.rate = (done - self.first) / max(now - self.start, 1e-6)
        if self.on_progress is not None and (now - self.last >= 0.1 or done >= total):
            self.last = now
            eta = (total - done) / self.rate if self.rate > 0 else None
            self.on_progress(DownloadProgress(done, total, self.rate, eta))


def cached_path(f: HubFile) -> Path | None:
    """The file's path in the hub cache when it is there complete, else None (no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(f.repo_id, f.filename, cache_dir=str(cache_dir()), revision=f.revision)
    return Path(found) if isinstance(found, str) else None
