"""The byte transfer of one hub file into the Hugging Face cache, resumable across restarts.

Layout (the hub cache's own): ``models--ORG--REPO/blobs/<etag>`` holds the content, ``snapshots/<commit>/<file>``
links to it, ``refs/<branch>`` names the commit. The bytes go to ``blobs/<etag>.incomplete``, a stable name, so a
transfer stopped by a cancel, a lost connection or a restart continues from the bytes already there (an HTTP range
request). The file gets its final name only after its size and the published sha256 match, so a partial or corrupt
file never appears where anything loads from. The lock is the one the hub client takes for the same blob."""
from __future__ import annotations

import errno
import hashlib
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

from engine.library import http

RETRIES = 5  # transport failures in a row before giving up
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ETAG = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # a sha256 or git sha1 on the hub; never "..", never a "/"
CHUNK = 1 << 20
SLOW_BYTES = 64 << 10


class _Cancelled(Exception):
    pass


class Stalled(Exception):
    """The hub sent less than SLOW_BYTES in a window of READ_S * 2 seconds (a trickle no read timeout catches)."""


class _Mismatch(Exception):
    def __init__(self, got: str):
        super().__init__(got)
        self.got = got


def _hash_file(path: Path, h, cancel: threading.Event | None) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            if cancel is not None and cancel.is_set():
                raise _Cancelled()
            h.update(chunk)


def _copy(response, out, done: int, size: int, report: Callable[[int, int], None],
          cancel: threading.Event | None) -> None:
    """The body into ``out`` as it arrives, reporting progress; Stalled when a window brings under SLOW_BYTES."""
    window, window_start, reported = 0, time.monotonic(), done
    for chunk in response.iter_bytes():  # pieces as they arrive, so a trickle is seen
        if cancel is not None and cancel.is_set():
            raise _Cancelled()
        out.write(chunk)
        done, window = done + len(chunk), window + len(chunk)
        now = time.monotonic()
        if now - window_start > 2 * http.READ_S:
            if window < SLOW_BYTES:
                raise Stalled(f"{window} bytes in {now - window_start:.0f} s")
            window, window_start = 0, now
        if done - reported >= CHUNK:
            report(done, size)
            reported = done
    report(done, size)


def transfer(url: str, headers: dict[str, str], partial: Path, size: int, sha256: str,
             report: Callable[[int, int], None], cancel: threading.Event | None) -> None:
    """Fills ``partial`` up to ``size`` bytes from ``url``, resuming from what it holds, then checks the sha256.
    ``report(done, total)`` after each chunk. Raises _Cancelled, _Mismatch (the partial file removed), OSError
    (the partial file removed when the disk is full) and the HTTP client's errors."""
    from huggingface_hub.utils import get_session

    failures = 0
    while True:
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:  # not ours to continue: start again
            partial.unlink()
            have = 0
        if have == size:
            break
        request = dict(headers, Range=f"bytes={have}-") if have else dict(headers)
        try:
            with get_session().stream("GET", url, headers=request, follow_redirects=True,
                                      timeout=http.timeout()) as response:  # no byte for READ_S: a ReadTimeout
                response.raise_for_status()
                mode = "ab" if have and response.status_code == 206 else "wb"  # 200: the server ignored the range
                with partial.open(mode) as out:
                    _copy(response, out, have if mode == "ab" else 0, size, report, cancel)
                    failures = 0
        except OSError as e:
            if e.errno == errno.ENOSPC:
                partial.unlink(missing_ok=True)
            raise
        except Exception as e:  # a cut connection: resume from what reached the disk, a few times
            grew = partial.exists() and partial.stat().st_size >= have + SLOW_BYTES
            failures = 1 if grew else failures + 1  # in a row: one that brought data first starts the count again
            if not (http.is_network_error(e) or isinstance(e, Stalled)) or failures > RETRIES:
                raise
            time.sleep(min(0.2 * failures, 2.0))
    if sha256:
        h = hashlib.sha256()
        _hash_file(partial, h, cancel)
        if h.hexdigest() != sha256.lower():
            partial.unlink(missing_ok=True)
            raise _Mismatch(h.hexdigest())


def unsafe_name(etag: str, commit: str, revision: str, filename: str) -> str | None:
    """What is wrong with the names that become paths in the cache (the hub's commit and ETag, the revision, the
    file's name), or None. Each must stay inside its folder: a hostile hub's ``../`` would write elsewhere."""
    if not _COMMIT.fullmatch(commit or ""):
        return f"commit {commit!r:.80} (not 40 hexadecimal digits)"
    if not _ETAG.fullmatch(etag or ""):
        return f"ETag {etag!r:.80} (not a hash)"
    for what, name in (("revision", revision), ("file name", filename)):
        parts = name.split("/")
        if not name or name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
            return f"{what} {name!r:.80} (not a relative path inside the repository)"
    return None


def place(storage: Path, etag: str, commit: str, revision: str, filename: str, partial: Path | None) -> Path:
    """Moves a complete ``partial`` to ``blobs/<etag>`` (when given) and links ``snapshots/<commit>/<filename>`` to it,
    recording ``refs/<revision>``. Returns the snapshot path."""
    from huggingface_hub.file_download import _create_symlink

    blob = storage / "blobs" / etag
    if partial is not None:
        os.replace(partial, blob)
    pointer = storage / "snapshots" / commit / filename
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if not pointer.exists():
        _create_symlink(str(blob), str(pointer), new_blob=partial is not None)
    if revision != commit:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / revision).write_text(commit, encoding="utf-8")
    return pointer
