"""llama.cpp's split GGUF files (``name-00001-of-00003.gguf`` ...) as one model.

The engine loads one GGUF file, so a complete set of parts is merged once into a single file, written beside the hub
cache (``$HF_HOME/ninfer-merged/<key>/<name>.gguf``, never inside it: the parts stay as the hub and other tools left
them) and named only once complete. The merged file holds part 1's metadata (without the ``split.*`` keys) and
every part's tensors, byte for byte. It takes as much disk again as the parts; removing a split model removes both."""
from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

from engine.library.errors import DownloadCancelled, LibraryError, cache_dir
from engine.library.hub import split_part

_SPLIT = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<of>\d{5})\.gguf$", re.IGNORECASE)


def base_name(filename: str) -> str:
    """``name.gguf`` for ``name-00001-of-00003.gguf`` (any part)."""
    m = _SPLIT.match(Path(filename).name)
    return f"{m.group('base')}.gguf" if m else Path(filename).name


def part_name(filename: str, no: int) -> str:
    m = _SPLIT.match(filename)
    if not m:
        raise ValueError(f"{filename} is not a split GGUF part")
    return f"{filename[:m.start('no')]}{no:05d}-of-{m.group('of')}.gguf"


def sibling_parts(first: Path) -> list[Path]:
    """Every part of the set ``first`` belongs to, in order; a LibraryError names the parts that are missing."""
    where = split_part(first.name)
    if where is None:
        raise LibraryError(f"{first.name} is not part of a split GGUF file.", "Pass the file itself.")
    parts = [first.with_name(part_name(first.name, no)) for no in range(1, where[1] + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise LibraryError(f"{base_name(first.name)} is split into {where[1]} files and {', '.join(missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} missing from {first.parent}.",
                           "Download every part (the model library downloads them all), then load part 1.")
    return parts


def merged_dir() -> Path:
    return cache_dir().parent / "ninfer-merged"


def merged_path(parts: list[Path]) -> Path:
    """Where the merged file of these parts goes: keyed by each part's real path, size and modification time, so
    a changed part gives a new file."""
    key = hashlib.sha256()
    for p in parts:
        st = p.stat()
        key.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return merged_dir() / key.hexdigest()[:32] / base_name(parts[0].name)


def ensure_merged(first: Path, cancel: threading.Event | None = None) -> Path:
    """The single GGUF file of the split set ``first`` starts, merged now unless it already was."""
    parts = sibling_parts(first)
    out = merged_path(parts)
    if out.exists():
        return out
    merge(parts, out, cancel)
    return out


def merge(parts: list[Path], out: Path, cancel: threading.Event | None = None) -> None:
    """Writes the parts' tensors, with part 1's metadata, into one GGUF file at ``out`` (named only once complete;
    a full disk or a cancel leaves nothing behind)."""
    import errno

    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    readers = [GGUFReader(p) for p in parts]
    first = readers[0]
    arch = first.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".incomplete")
    writer = GGUFWriter(tmp, arch)
    for name, field in first.fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue  # the reader's own fields, the split's bookkeeping, and what the writer adds itself
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    tensors = [t for r in readers for t in r.tensors]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled(f"Merging the parts of {out.name} was cancelled.",
                                        "Load it again to merge it.")
            writer.write_tensor_data(t.data)
        writer.close()
        os.replace(tmp, out)
    except OSError as e:
        writer.close()
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise LibraryError(f"The disk holding {out.parent} is full: merging the {len(parts)} parts of "
                               f"{out.name} needs {sum(p.stat().st_size for p in parts) / 2**30:.2f} GiB; nothing "
                               f"was left behind.", "Free space on that disk, or point HF_HOME at a disk with room."
                               ) from e
        raise LibraryError(f"Cannot write {tmp}: {e.strerror or e}.",
                           "Check that the folder is writable, or point HF_HOME at one that is.") from e
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
