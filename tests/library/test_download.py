"""Downloads into the hub cache from the stand-in hub: progress, resume after a cut, the published sha256,
cancellation, a full disk, and the hf: resolver (online and offline)."""
from __future__ import annotations

import errno
import hashlib
import threading
from pathlib import Path

import pytest

from engine.library import download as dl, hub as libhub
from engine.library.resolve import cached_files, parse_spec, resolve_hf

REPO = "test-org/Tiny-Llama-GGUF"


def _file(quant: str = "Q4_K_M") -> libhub.HubFile:
    return next(f for f in libhub.list_files(REPO) if f.quant == quant)


def _loadable_files(hf_home: Path) -> list[Path]:
    """What the library (and any tool reading the hub cache) would load: GGUF files under snapshots/."""
    return [p for p in (hf_home / "hub").rglob("*.gguf") if p.exists()]


def _leftovers(hf_home: Path) -> list[Path]:
    return [p for p in (hf_home / "hub").rglob("*") if p.is_file() and "blobs" in p.parts]


def test_download_lands_in_the_hub_cache_with_progress(tiny_repo, hf_home):
    seen = []
    path = dl.download(_file(), on_progress=seen.append)
    assert path.read_bytes() == tiny_repo.files["Tiny-Llama-Q4_K_M.gguf"]
    assert path.is_relative_to(hf_home / "hub" / "models--test-org--Tiny-Llama-GGUF" / "snapshots")
    assert seen[-1].done == seen[-1].total == len(tiny_repo.files["Tiny-Llama-Q4_K_M.gguf"])
    assert all(p.rate >= 0 for p in seen) and seen[-1].fraction == 1.0
    # other tools find it where they look: huggingface_hub's own cache scan
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in scan_cache_dir(hf_home / "hub").repos}
    assert REPO in repos and repos[REPO].size_on_disk == path.stat().st_size


def test_a_second_download_reuses_the_cached_file(tiny_repo, hub):
    f = _file()
    first = dl.download(f)
    gets = len([r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]])
    assert dl.download(f) == first
    assert len([r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]) == gets  # no second transfer


def test_a_download_cut_halfway_resumes_and_verifies(tiny_repo, hub, monkeypatch):
    monkeypatch.setattr("engine.library.transfer.CHUNK", 64 * 1024)
    name = "Tiny-Llama-Q8_0.gguf"
    hub.cut.add(name)
    path = dl.download(_file("Q8_0"))
    data = tiny_repo.files[name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == tiny_repo.sha(name)
    ranges = [r[2] for r in hub.requests if r[0] == "GET" and r[1].endswith(name)]
    # the first transfer was cut; the second asked only for the rest
    assert len(ranges) == 2 and ranges[0] == "" and ranges[1].startswith("bytes=")
    resumed_at = int(ranges[1][6:].split("-")[0])
    assert 0 < resumed_at < len(data)


def test_a_cancelled_download_continues_where_it_stopped_after_a_restart(tiny_repo, hub, hf_home, monkeypatch):
    monkeypatch.setattr("engine.library.transfer.CHUNK", 64 * 1024)
    name = "Tiny-Llama-Q8_0.gguf"
    cancel = threading.Event()
    with pytest.raises(dl.DownloadCancelled, match="cancelled") as e:
        dl.download(_file("Q8_0"), on_progress=lambda p: cancel.set(), cancel=cancel)
    assert "continue" in e.value.remedy
    partial = [p for p in _leftovers(hf_home) if p.name.endswith(".incomplete")]
    assert len(partial) == 1 and 0 < partial[0].stat().st_size < len(tiny_repo.files[name])
    assert _loadable_files(hf_home) == [] and dl.cached_path(_file("Q8_0")) is None
    kept = partial[0].stat().st_size
    # a new process: nothing in memory, only the partial file on disk
    seen = []
    path = dl.download(_file("Q8_0"), on_progress=seen.append)
    assert path.read_bytes() == tiny_repo.files[name]
    ranges = [r[2] for r in hub.requests if r[0] == "GET" and r[1].endswith(name)]
    assert ranges[-1] == f"bytes={kept}-"
    assert seen[0].done > kept and seen[-1].done == len(tiny_repo.files[name])
    assert [p for p in _leftovers(hf_home) if p.name.endswith(".incomplete")] == []


def test_a_wrong_hash_is_refused_and_the_file_is_not_used(tiny_repo, hf_home):
    name = "Tiny-Llama-Q4_K_M.gguf"
    tiny_repo.published[name] = "ab" * 32  # the hub publishes a hash the bytes do not have
    with pytest.raises(dl.HashMismatch, match="sha256") as e:
        dl.download(_file())
    assert "removed" in e.value.problem and "again" in e.value.remedy
    assert _loadable_files(hf_home) == [] and _leftovers(hf_home) == []


def test_cancel_leaves_no_file_the_library_would_load(tiny_repo, hf_home, monkeypatch):
    monkeypatch.setattr("engine.library.transfer.CHUNK", 4096)
    cancel = threading.Event()

    def progress(p):
        if p.done < p.total:
            cancel.set()  # cancel from the progress callback, as the app's button would between two chunks

    with pytest.raises(dl.DownloadCancelled, match="cancelled"):
        dl.download(_file(), on_progress=progress, cancel=cancel)
    assert _loadable_files(hf_home) == [] and dl.cached_path(_file()) is None
    assert all(p.name.endswith(".incomplete") for p in _leftovers(hf_home))  # only the partial file, to resume


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_behind(tiny_repo, hf_home, monkeypatch):
    real_open = Path.open

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            if self.written + len(data) > 100_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def patched(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode and self.name.endswith(".incomplete") else f

    monkeypatch.setattr(Path, "open", patched)
    with pytest.raises(libhub.LibraryError, match="full") as e:
        dl.download(_file())
    assert "HF_HOME" in e.value.remedy and "Free space" in e.value.remedy
    assert _loadable_files(hf_home) == [] and _leftovers(hf_home) == []


def test_hf_spec_resolves_downloads_then_works_offline(tiny_repo, hf_home, monkeypatch):
    path = resolve_hf(f"hf:{REPO}:Q8_0")
    assert path.name == "Tiny-Llama-Q8_0.gguf" and path.read_bytes() == tiny_repo.files[path.name]
    assert resolve_hf(f"hf:{REPO}").name == "Tiny-Llama-Q4_K_M.gguf"  # no quant named: the usual one
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_hf(f"hf:{REPO}:Q8_0") == path
    assert {p.name for p in cached_files(REPO)} == {"Tiny-Llama-Q8_0.gguf", "Tiny-Llama-Q4_K_M.gguf"}


def test_hf_spec_offline_and_not_cached_is_a_clear_error(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(libhub.OfflineError, match="not in the model cache") as e:
        resolve_hf(f"hf:{REPO}:Q4_K_M")
    assert "HF_HUB_OFFLINE" in e.value.problem and "network" in e.value.remedy


def test_the_loader_accepts_hf_specs(tiny_repo, hf_home, monkeypatch):
    from engine.model.loader import resolve_model_path

    path = resolve_model_path(f"hf:{REPO}:Q4_K_M")
    assert path.is_file() and path.name == "Tiny-Llama-Q4_K_M.gguf"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(libhub.OfflineError, match="Q8_0 is not in the model cache"):
        resolve_model_path(f"hf:{REPO}:Q8_0")


def test_unknown_quant_and_bad_spec_name_what_to_do(tiny_repo):
    with pytest.raises(libhub.LibraryError, match="no complete Q2_K") as e:
        resolve_hf(f"hf:{REPO}:Q2_K")
    assert "Q4_K_M" in e.value.remedy and "Q8_0" in e.value.remedy and "mmproj" not in e.value.remedy
    with pytest.raises(libhub.LibraryError, match="not a hub model reference"):
        parse_spec("hf:justaname")
    assert parse_spec("hf:org/repo:q4_k_m") == ("org/repo", "Q4_K_M")


def test_a_file_another_tool_downloaded_is_reused_and_checked(tiny_repo, hub, hf_home):
    from huggingface_hub import hf_hub_download

    theirs = hf_hub_download(REPO, "Tiny-Llama-Q4_K_M.gguf", cache_dir=str(hf_home / "hub"), endpoint=hub.url)
    gets = len([r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]])
    ours = dl.download(_file())
    assert ours == Path(theirs)
    assert len([r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]) == gets
    assert dl.is_verified(ours, tiny_repo.sha("Tiny-Llama-Q4_K_M.gguf"))


def test_a_gated_repository_asks_for_a_token_and_works_with_one(tiny_repo, hub, monkeypatch, caplog):
    tiny_repo.gated_token = "hf_secret_for_the_test"
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_right_one")
    with pytest.raises(libhub.LibraryError, match="gated") as e:
        libhub.list_files(REPO)
    assert "hf auth login" in e.value.remedy and "HF_TOKEN" in e.value.remedy
    monkeypatch.setenv("HF_TOKEN", tiny_repo.gated_token)
    with caplog.at_level("DEBUG"):
        path = resolve_hf(f"hf:{REPO}:Q4_K_M")
    assert path.read_bytes() == tiny_repo.files["Tiny-Llama-Q4_K_M.gguf"]
    assert tiny_repo.gated_token not in caplog.text


def test_a_cache_only_resolution_never_downloads(tiny_repo, hub):
    with pytest.raises(libhub.LibraryError, match="has not been downloaded yet") as e:
        resolve_hf(f"hf:{REPO}:Q8_0", download_missing=False)
    assert f"python -m engine.library download hf:{REPO}:Q8_0" in e.value.remedy
    assert not [r for r in hub.requests if "/resolve/" in r[1]]
    path = resolve_hf(f"hf:{REPO}:Q8_0")
    assert resolve_hf(f"hf:{REPO}:Q8_0", download_missing=False) == path
