"""A hub that misbehaves, from the stand-in hub: one that never answers or stalls mid-file is a timeout and a clear
error with the partial file kept to resume (never a hang); an unreachable HF_ENDPOINT fails at once; names the hub
sends that would become paths outside the cache (``../`` in X-Repo-Commit or ETag) are refused before anything
is written."""
from __future__ import annotations

import socket
import time

import pytest

from engine.library import download as dl, http, hub as libhub, transfer
from engine.library.errors import LibraryError, OfflineError

REPO = "test-org/Tiny-Llama-GGUF"
NAME = "Tiny-Llama-Q4_K_M.gguf"


@pytest.fixture
def short_timeouts(monkeypatch):
    """Timeouts of a second (the shipped ones are 10 s to connect, 30 s without a byte), two retries."""
    from huggingface_hub import close_session

    monkeypatch.setattr(http, "READ_S", 1.0)
    monkeypatch.setattr(http, "CONNECT_S", 1.0)
    monkeypatch.setattr(transfer, "RETRIES", 2)
    monkeypatch.setattr(http, "_reached", {})
    close_session()  # the next session is made with the timeouts above
    yield
    close_session()


def _file() -> libhub.HubFile:
    return next(f for f in libhub.list_files(REPO) if f.filename == NAME)


def _partial(hf_home):
    return [p for p in (hf_home / "hub").rglob("*.incomplete")]


def test_a_hub_that_never_answers_is_an_error_within_the_timeout(tiny_repo, hub, short_timeouts):
    hub.silent = True
    t = time.perf_counter()
    with pytest.raises(OfflineError, match="cannot be reached"):
        libhub.list_files(REPO)
    assert time.perf_counter() - t < 10


def test_a_file_that_stalls_is_an_error_and_resumes_from_what_arrived(tiny_repo, hub, hf_home, short_timeouts):
    f = _file()
    hub.stall[NAME] = 200_000
    t = time.perf_counter()
    with pytest.raises(LibraryError, match="stopped sending") as e:
        dl.download(f)
    assert time.perf_counter() - t < 20
    assert "continues from the part" in e.value.remedy
    (partial,) = _partial(hf_home)
    assert partial.stat().st_size == 200_000  # kept, to resume
    del hub.stall[NAME]
    hub.requests.clear()
    path = dl.download(f)
    assert path.read_bytes() == tiny_repo.files[NAME]
    assert [r for r in hub.requests if r[0] == "GET" and r[1].endswith(NAME)][-1][2] == "bytes=200000-"


def test_a_trickle_no_read_timeout_catches_is_a_stall(tiny_repo, hub, monkeypatch, short_timeouts):
    f = _file()
    monkeypatch.setattr(transfer, "SLOW_BYTES", 10_000)
    hub.rate = 2_000  # bytes per second: a byte every read, never a silence of READ_S
    t = time.perf_counter()
    with pytest.raises(LibraryError, match="stopped sending"):
        dl.download(f)
    assert time.perf_counter() - t < 30
    hub.rate = 0


def test_an_unreachable_endpoint_fails_at_once(hf_home, monkeypatch, short_timeouts):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for call in (lambda: libhub.list_files(REPO), lambda: libhub.search("llama")):
        t = time.perf_counter()
        with pytest.raises(OfflineError, match=f"127.0.0.1:{port} cannot be reached"):
            call()
        assert time.perf_counter() - t < 3


@pytest.mark.parametrize("header, value", [("X-Repo-Commit", "../../../../outside"),
                                           ("ETag and X-Linked-Etag", '"../../../../outside"'),
                                           ("X-Linked-Etag", '"../../../../outside"')])
def test_a_hub_name_that_would_leave_the_cache_is_refused_before_anything_is_written(tiny_repo, hub, hf_home, tmp_path,
                                                                                     header, value):
    f = _file()
    before = sorted(p for p in tmp_path.rglob("*") if "hf-home" not in p.parts)
    hub.file_headers = {h: value for h in header.split(" and ")}
    with pytest.raises(LibraryError, match="unsafe") as e:
        dl.download(f)
    assert "nothing was written" in e.value.problem
    assert sorted(p for p in tmp_path.rglob("*") if "hf-home" not in p.parts) == before
    assert not (hf_home / "hub" / "models--test-org--Tiny-Llama-GGUF" / "blobs").exists()
    assert not list((hf_home / "hub").rglob("*.lock")) and not list((hf_home / "hub").rglob("outside*"))


def test_a_file_name_or_revision_outside_the_repository_is_unsafe():
    ok = ("a" * 64, "b" * 40)
    assert transfer.unsafe_name(*ok, "main", "sub/x.gguf") is None
    for revision, filename in (("main", "../x.gguf"), ("main", "/etc/x.gguf"), ("../..", "x.gguf"),
                               ("main", "a\\..\\x.gguf"), ("main", "a//x.gguf")):
        assert transfer.unsafe_name(*ok, revision, filename) is not None, (revision, filename)
