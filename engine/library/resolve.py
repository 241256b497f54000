"""``hf:ORG/REPO[:QUANT]`` as a model path: the GGUF file of that quant in that repository, downloaded into the hub
cache when it is not there yet (verified against the hub's sha256), and its local path returned. Without a network
(or with HF_HUB_OFFLINE set) a file already in the cache is used; otherwise the error says it is not there."""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Callable

from engine.library.download import DownloadProgress, cache_dir, download, verify
from engine.library.hub import HubFile, LibraryError, OfflineError, list_files, offline, quant_of, split_part
from engine.library.split import ensure_merged

log = logging.getLogger("ninfer.library")
PREFIX = "hf:"
PREFERRED = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q4_0", "Q6_K", "Q8_0")  # when no quant is named
_SPEC = re.compile(r"^hf:([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+))?$")


def is_hf_spec(model: object) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


def parse_spec(spec: str) -> tuple[str, str]:
    """(repo_id, quant or "") from ``hf:ORG/REPO[:QUANT]``."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise LibraryError(f"{spec!r} is not a hub model reference.",
                           "Write hf:ORG/REPO or hf:ORG/REPO:QUANT, e.g. hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M.")
    return m.group(1), (m.group(2) or "").upper()


def _loadable(name: str) -> bool:
    base = name.rsplit("/", 1)[-1].lower()
    return base.endswith(".gguf") and not base.startswith("mmproj") and split_part(name) is None


def pick(files: list[HubFile], repo_id: str, quant: str) -> HubFile:
    """The file for ``quant`` (or the preferred quant when none is named); a LibraryError lists what there is."""
    usable = [f for f in files if f.parts or _loadable(f.filename)]
    quants = sorted({f.quant or f.filename for f in usable})
    if quant:
        match = [f for f in usable if f.quant == quant]
        if not match:
            split = [f for f in files if f.quant == quant and split_part(f.filename)]
            why = " (only a split file with parts missing)" if split else ""
            raise LibraryError(f"hf:{repo_id} has no complete {quant} GGUF{why}.",
                               f"Pick one of: {', '.join(quants) or 'none: the repository has no loadable GGUF'}.")
        return match[0]
    if not usable:
        raise LibraryError(f"hf:{repo_id} has no complete GGUF this engine can load.",
                           "Pick another repository (search with the model library).")
    if len(usable) == 1:
        return usable[0]
    for q in PREFERRED:
        for f in usable:
            if f.quant == q:
                return f
    raise LibraryError(f"hf:{repo_id} has several GGUF files and none of the usual quants.",
                       f"Name one: hf:{repo_id}:QUANT with QUANT one of {', '.join(quants)}.")


def cached_files(repo_id: str) -> list[Path]:
    """The GGUF files of a repository in the hub cache (every snapshot), newest snapshot first."""
    root = cache_dir() / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    if not root.is_dir():
        return []
    snaps = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    out = []
    for p in (p for s in snaps for p in sorted(s.rglob("*.gguf")) if p.exists()):
        if _loadable(p.name):
            out.append(p)
        elif (part := split_part(p.name)) is not None and part[0] == 1 and not p.name.lower().startswith("mmproj"):
            try:
                out.append(ensure_merged(p))  # a split model: its parts merged once into one file
            except LibraryError:
                pass  # parts missing: not a model yet
    return out


def _from_cache(repo_id: str, quant: str, why: str = "") -> Path:
    found = cached_files(repo_id)
    if quant:
        found = [p for p in found if quant_of(p.name) == quant]
    elif len({quant_of(p.name) for p in found}) > 1:
        pref = [p for q in PREFERRED for p in found if quant_of(p.name) == q]
        found = pref or found
    if not found:
        what = f"hf:{repo_id}" + (f":{quant}" if quant else "")
        if not why:
            raise LibraryError(f"{what} has not been downloaded yet (it is not in {cache_dir()}).",
                               f"Download it first: python -m engine.library download {what}")
        raise OfflineError(f"{what} is not in the model cache ({cache_dir()}) and the hub cannot be used: {why}.",
                           "Connect to the network (and unset HF_HUB_OFFLINE), or pass the path of a GGUF file "
                           "on disk.")
    path = found[0]
    blob = path.resolve().name
    if re.fullmatch(r"[0-9a-f]{64}", blob):  # an LFS blob is named by its sha256: check it once
        verify(path, blob)
    return path


def _log_progress() -> Callable[[DownloadProgress], None]:
    last = [-1]

    def report(p: DownloadProgress) -> None:
        step = int(p.fraction * 10)
        if step != last[0]:
            last[0] = step
            eta = f", {p.eta_s:.0f} s left" if p.eta_s else ""
            log.info("downloading: %.0f%% of %.2f GiB at %.1f MiB/s%s", p.fraction * 100, p.total / 2**30,
                     p.rate / 2**20, eta)
    return report


def resolve_hf(spec: str, on_progress: Callable[[DownloadProgress], None] | None = None,
               cancel: threading.Event | None = None, *, download_missing: bool = True) -> Path:
    """The local path of ``hf:ORG/REPO[:QUANT]``, downloading it first when needed (``download_missing=False``: the
    cached file only, no network, e.g. for a quick check before a download the user confirms)."""
    repo_id, quant = parse_spec(spec)
    if not download_missing:
        return _from_cache(repo_id, quant)
    if offline():
        return _from_cache(repo_id, quant, "offline mode is on (HF_HUB_OFFLINE)")
    try:
        files = list_files(repo_id)
    except OfflineError as e:
        return _from_cache(repo_id, quant, e.problem.rstrip("."))
    f = pick(files, repo_id, quant)
    log.info("hf:%s: %s (%.2f GiB)", repo_id, f.filename, f.size / 2**30)
    path = download(f, on_progress=on_progress or _log_progress(), cancel=cancel)
    if f.mmproj is not None:  # the vision projector too, beside the model, where the engine looks for it
        log.info("hf:%s: vision projector %s (%.2f GiB)", repo_id, f.mmproj.filename, f.mmproj.size / 2**30)
        download(f.mmproj, on_progress=on_progress or _log_progress(), cancel=cancel)
    return path
