"""Files a user names on a command line (a config, a preset, an eval text, a results file). They are read only when
they are regular files of bounded size, and written only into a folder that exists. A device, a named pipe or a
typo in a folder name then gets a clear error, not a hang, an out-of-memory kill or a new folder tree."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from engine.errors import NInferError


def special_kind(path: Path) -> str:
    """What a path that is neither a regular file nor a folder is, in words."""
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "folder")):
        if test(mode):
            return name
    return "special file"


def read_user_file(path: Path, what: str, max_bytes: int, remedy: str) -> bytes:
    """The bytes of a regular file of at most max_bytes. FileNotFoundError as open() raises it; an NInferError
    naming `what` for anything else that is not a readable regular file of that size."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise NInferError(f"Cannot read {what} {path}: {e.strerror or e}.", remedy) from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO blocks forever, /dev/zero never ends
        raise NInferError(f"{what.capitalize()} {path} is a {special_kind(path)}, not a regular file.", remedy)
    too_big = NInferError(f"{what.capitalize()} {path} is larger than {max_bytes / 2**20:g} MiB, the most read as "
                          f"{what}.", remedy)
    if st.st_size > max_bytes:
        raise too_big
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # a file that grows (or lies about its size) is still read only this far
    except FileNotFoundError:
        raise
    except OSError as e:
        raise NInferError(f"Cannot read {what} {path}: {e.strerror or e}.", remedy) from None
    if len(data) > max_bytes:
        raise too_big
    return data


def check_write_target(path: Path, what: str, remedy: str) -> None:
    """A file about to be created or appended to: its folder must exist, and the file, when it exists, must be a
    regular file (appending to /dev/full or a pipe is refused before any work is done)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise NInferError(f"The folder of {what} {path} does not exist ({path.parent}).",
                          f"Create the folder first, or {remedy[0].lower() + remedy[1:]}")
    if path.exists() and not path.is_file():
        raise NInferError(f"{what.capitalize()} {path} is a {special_kind(path)}, not a regular file.", remedy)


def write_replacing(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` (its folder created) through a temporary file beside it that replaces it, so a
    crash mid-write never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
