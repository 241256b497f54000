"""llama.cpp's vision projector files (mmproj*.gguf, architecture `clip`) beside a model's GGUF: not models of their
own, but the image side of the model next to them (a repository's or a folder's). Standard library only, like the
rest of the library: the engine's loader (engine/model/gguf_mmproj.py) and the listings share these rules."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

PREFIX = "mmproj"
# several projector files beside one model (one per precision): the one a listing shows, the most precise first
PREFERRED = ("F32", "BF16", "F16", "Q8_0")


def is_mmproj(name: str | Path) -> bool:
    """Whether a file's name is a vision projector's: mmproj*.gguf, as llama.cpp's converter and the hub's repositories
    name them (mmproj-F16.gguf, mmproj-Qwen3.5-9B-BF16.gguf)."""
    base = Path(name).name.lower()
    return base.startswith(PREFIX) and base.endswith(".gguf")


def mmproj_beside(model: Path) -> list[Path]:
    """The mmproj*.gguf files in the model file's folder, by name (the folder as given: in the hub cache, a snapshot
    folder of links, never the blob store they point into)."""
    folder = Path(model).parent
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if is_mmproj(p.name) and p.is_file())


def preferred(files: list, name: Callable[[Any], str] = lambda f: Path(f).name):
    """The one a listing names among several projector files (paths, or anything `name` names): the most precise
    by PREFERRED, else the first; None for none."""
    if not files:
        return None
    for kind in PREFERRED:
        for f in files:
            if kind.lower() in name(f).lower():
                return f
    return files[0]

