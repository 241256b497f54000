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
import threading
import time
from pathlib import Path
from typing import Callable

RETRIES = 5  # transport failures in a row before giving up
CHUNK = 1 << 20


class _Cancelled(Exception):
    pass


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
            with get_session().stream("GET", url, headers=request, follow_redirects=True) as response:
                response.raise_for_status()
                mode = "ab" if have and response.status_code == 206 else "wb"  # 200: the server ignored the range
                done = have if mode == "ab" else 0
                with partial.open(mode) as out:
                    for chunk in response.iter_bytes(CHUNK):
                        if cancel is not None and cancel.is_set():
                            raise _Cancelled()
                        out.write(chunk)
                        done += len(chunk)
                        failures = 0
                        report(done, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                partial.unlink(missing_ok=True)
            raise
        except Exception as e:  # a cut connection: resume from what reached the disk, a few times
            from engine.library.hub import is_network_error

            failures += 1
            if not is_network_error(e) or failures > RETRIES:
                raise
            time.sleep(min(0.2 * failures, 2.0))
    if sha256:
        h = hashlib.sha256()
        _hash_file(partial, h, cancel)
        if h.hexdigest() != sha256.lower():
            partial.unlink(missing_ok=True)
            raise _Mismatch(h.hexdigest())


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
