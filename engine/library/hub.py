"""Find GGUF models on the Hugging Face hub: search repositories, list a repository's GGUF files with their size,
quant type, published sha256 and the architecture the hub reports. Every call honours HF_ENDPOINT (read when called)
and fails with a LibraryError that says what to do."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from engine.library.errors import LibraryError, OfflineError
from engine.library.http import is_network_error
from engine.library.token import load_token

_QUANT = re.compile(r"(?:^|[-._])((?:I?Q|TQ)\d(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4)(?=[-.])", re.IGNORECASE)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _api():
    from huggingface_hub import HfApi


    return HfApi(endpoint=endpoint(), token=load_token())


def quant_of(filename: str) -> str:
    """The quant type a GGUF file's name carries (Q4_K_M, IQ3_XXS, F16 ...), upper case; "" when it names none."""
    m = _QUANT.search(os.path.basename(filename))
    return m.group(1).upper() if m else ""


def split_part(filename: str) -> tuple[int, int] | None:
    """(part, of) for llama.cpp's split files (name-00001-of-00003.gguf), else None."""
    m = _SPLIT.search(filename)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class RepoResult:
    repo_id: str
    downloads: int = 0
    likes: int = 0
    gated: bool = False
    architecture: str = ""  # from the hub's GGUF summary, "" when it gives none
    context_length: int = 0
    parameters: int = 0


@dataclass(frozen=True)
class HubFile:
    repo_id: str
    filename: str
    size: int
    sha256: str  # the hub's published sha256 of the file's content ("" for a file outside LFS)
    quant: str
    architecture: str = ""
    revision: str = "main"
    parts: tuple["HubFile", ...] = ()  # a split model: every part, part 1 first (this entry is part 1, size the sum)
    mmproj: "HubFile | None" = None  # the vision projector in its folder (engine/library/mmproj.py), if any

    @property
    def vision(self) -> bool:
        return self.mmproj is not None

    @property
    def split(self) -> tuple[int, int] | None:
        return split_part(self.filename)


def group_splits(files: list[HubFile]) -> list[HubFile]:
    """Each complete set of split parts as one entry (part 1, with the total size and ``parts``); a set with parts
    missing stays as its parts."""
    import dataclasses

    sets: dict[tuple[str, int], list[HubFile]] = {}
    for f in files:
        if f.split:
            stem = f.filename[:f.filename.rfind("-", 0, f.filename.rfind("-of-"))]
            sets.setdefault((stem, f.split[1]), []).append(f)
    out = []
    for f in files:
        if not f.split:
            out.append(f)
            continue
        stem = f.filename[:f.filename.rfind("-", 0, f.filename.rfind("-of-"))]
        group = sorted(sets[(stem, f.split[1])], key=lambda g: g.split[0])
        if [g.split[0] for g in group] != list(range(1, f.split[1] + 1)):
            out.append(f)  # incomplete: listed part by part, and marked so
        elif f.split[0] == 1:
            out.append(dataclasses.replace(f, size=sum(g.size for g in group), parts=tuple(group)))
    return out


def _hub_error(e: Exception, what: str) -> LibraryError:
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(e, OfflineModeIsEnabled) or offline():
        return OfflineError(f"Cannot {what}: offline mode is on (HF_HUB_OFFLINE).",
                            "Unset HF_HUB_OFFLINE to search and download; models already downloaded still work.")
    if isinstance(e, GatedRepoError):
        return LibraryError(f"Cannot {what}: the repository is gated and needs an accepted licence and a token.",
                            "Accept its terms on the hub, then give a token: the app's model library keeps "
                            "it in the OS keyring; or log in with `hf auth login`, or set HF_TOKEN.")
    if isinstance(e, RepositoryNotFoundError):
        return LibraryError(f"Cannot {what}: no such repository on {endpoint()} (or it is private).",
                            "Check the ORG/REPO name; for a private repository log in with `hf auth login`.")
    if is_network_error(e):
        return OfflineError(f"Cannot {what}: {endpoint()} cannot be reached ({type(e).__name__}: {e}).",
                            "Check the network connection (or HF_ENDPOINT); models already downloaded still work.")
    return LibraryError(f"Cannot {what}: the hub answered {type(e).__name__}: {e}.",
                        "Try again later; if it persists, check HF_ENDPOINT.")


def _guard(what: str):
    if offline():
        raise OfflineError(f"Cannot {what}: offline mode is on (HF_HUB_OFFLINE).",
                           "Unset HF_HUB_OFFLINE to search and download; models already downloaded still work.")
    from engine.library.http import check_reachable

    check_reachable(endpoint(), what)


def search(query: str, limit: int = 20) -> list[RepoResult]:
    """GGUF repositories matching ``query``, most downloaded first."""
    _guard("search the hub")
    try:
        models = list(_api().list_models(search=query or None, filter="gguf", sort="downloads", limit=limit,
                                         expand=["downloads", "likes", "gated", "gguf"]))
    except Exception as e:  # the hub client raises many types; each becomes a LibraryError that names it
        raise _hub_error(e, f"search the hub for {query!r}") from e
    out = []
    for m in models:
        g = getattr(m, "gguf", None) or {}
        out.append(RepoResult(m.id, int(m.downloads or 0), int(m.likes or 0), bool(m.gated),
                              str(g.get("architecture") or ""), int(g.get("context_length") or 0),
                              int(g.get("total") or 0)))
    return out


def repo_architecture(repo_id: str, revision: str = "main") -> str:
    """The architecture the hub's GGUF summary gives for a repository, "" when it gives none."""
    try:
        info = _api().model_info(repo_id, revision=revision, expand=["gguf"])
    except Exception:  # optional information: its absence is reported as ""
        return ""
    return str((getattr(info, "gguf", None) or {}).get("architecture") or "")


def with_projectors(files: list[HubFile]) -> list[HubFile]:
    """The model files, each with the vision projector (mmproj*.gguf) of its folder; projectors are not models of
    their own, so they are not listed."""
    import dataclasses
    import posixpath

    from engine.library.mmproj import is_mmproj, preferred

    projectors = [f for f in files if is_mmproj(f.filename)]
    folder = lambda f: posixpath.dirname(f.filename)  # noqa: E731
    return [dataclasses.replace(f, mmproj=preferred([p for p in projectors if folder(p) == folder(f)],
                                                    lambda p: posixpath.basename(p.filename)))
            for f in files if not is_mmproj(f.filename)]


def list_files(repo_id: str, revision: str = "main") -> list[HubFile]:
    """The repository's .gguf models with size, quant, the published sha256 and the hub's architecture; a split
    model's parts as one entry (see group_splits); a vision projector as the `mmproj` of the models beside it."""
    _guard(f"list the files of {repo_id}")
    try:
        from huggingface_hub.hf_api import RepoFile

        entries = [e for e in _api().list_repo_tree(repo_id, recursive=True, revision=revision)
                   if isinstance(e, RepoFile) and e.path.lower().endswith(".gguf")]
    except Exception as e:  # each hub error becomes a LibraryError that names it
        raise _hub_error(e, f"list the files of {repo_id}") from e
    arch = repo_architecture(repo_id, revision) if entries else ""
    return with_projectors(group_splits([HubFile(repo_id, e.path, int(e.lfs.size if e.lfs else e.size),
                                                 e.lfs.sha256 if e.lfs else "", quant_of(e.path), arch, revision)
                                         for e in sorted(entries, key=lambda e: e.path)]))


def file_url(f: HubFile) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(f.repo_id, f.filename, revision=f.revision, endpoint=endpoint())


def auth_headers() -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers


    return build_hf_headers(token=load_token())
