"""Find and load a model: a GGUF file or a Hugging Face folder, or the embedded default."""
from __future__ import annotations

import threading
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.weights import LoadedWeights, Progress
from engine.userfiles import special_kind


def resolve_model_path(model: str | Path | None) -> Path:
    if model in (None, ""):
        from engine.model.default import default_model_path
        return default_model_path()
    if isinstance(model, str) and model.startswith("hf:"):  # hf:ORG/REPO[:QUANT]: engine/library/resolve.py
        from engine.library.resolve import resolve_hf
        return resolve_hf(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"Model not found: {path}.",
                             "Pass the path of a .gguf file or of a Hugging Face model folder "
                             "(or no model, to use the embedded SmolLM2-135M-Instruct).")
    if not path.is_dir() and not path.is_file():  # a FIFO, socket or device: reading it could block forever
        raise ModelLoadError(f"{path} is not a regular file or folder (it is a {special_kind(path)}).",
                             "Pass the path of a .gguf file or of a Hugging Face model folder.")
    from engine.library.hub import split_part
    if split_part(path.name) is not None:  # llama.cpp's split files: merged once into one (engine/library/split.py)
        from engine.library.split import ensure_merged, sibling_parts
        return ensure_merged(sibling_parts(path)[0])
    return path


def load_weights(model: str | Path | None, progress: Progress | None = None,
                 cancel: threading.Event | None = None, native: bool = False) -> tuple[Path, LoadedWeights]:
    """native: keep GGUF low-bit linear weights as stored (see gguf_file.load_gguf); HF folders load dense."""
    path = resolve_model_path(model)
    if path.is_dir():
        from engine.model.hf_folder import load_folder
        return path, load_folder(path, progress, cancel)
    if path.suffix.lower() != ".gguf":
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path.name} is neither a GGUF file nor a model folder.",
                                 "Pass a .gguf file or a folder with config.json and *.safetensors.")
    from engine.model.gguf_file import load_gguf
    return path, load_gguf(path, progress, cancel, native)
