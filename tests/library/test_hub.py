"""Search and listing against the stand-in hub, and the ledger's marks for each file before any download."""
from __future__ import annotations

import pytest

from engine.library import fit, hub as libhub
from engine.library.header import read_local_header
from tests.library.conftest import Repo, write_gguf


def test_quant_is_read_from_the_file_name():
    assert libhub.quant_of("Qwen3-8B-Q4_K_M.gguf") == "Q4_K_M"
    assert libhub.quant_of("org/sub/model.IQ3_XXS.gguf") == "IQ3_XXS"
    assert libhub.quant_of("model-bf16-00001-of-00002.gguf") == "BF16"
    assert libhub.quant_of("model-UD-Q8_0.gguf") == "Q8_0"
    assert libhub.quant_of("model.gguf") == ""
    assert libhub.split_part("m-Q4_0-00002-of-00003.gguf") == (2, 3)


def test_search_and_list_files_with_size_quant_sha_and_architecture(tiny_repo, hub):
    hub.add(Repo("other/Unrelated", {}))
    results = libhub.search("tiny")
    assert [r.repo_id for r in results] == ["test-org/Tiny-Llama-GGUF"]
    assert results[0].architecture == "llama"
    files = libhub.list_files("test-org/Tiny-Llama-GGUF")
    by_name = {f.filename: f for f in files}
    q4 = by_name["Tiny-Llama-Q4_K_M.gguf"]
    assert q4.quant == "Q4_K_M" and q4.size == len(tiny_repo.files[q4.filename])
    assert q4.sha256 == tiny_repo.sha(q4.filename) and q4.architecture == "llama"
    # the vision projector is no model of its own: each model beside it carries it
    assert "mmproj-Tiny-F16.gguf" not in by_name
    assert q4.vision and (q4.mmproj.filename, q4.mmproj.quant) == ("mmproj-Tiny-F16.gguf", "F16")


def test_header_from_ranges_matches_the_whole_file(tiny_repo, hub, tmp_path):
    f = next(f for f in libhub.list_files(tiny_repo.repo_id) if f.quant == "Q8_0")
    marks = fit.mark_hub_file(f, vram_mib=0, ram_mib=16_000)
    assert marks.mark == fit.FITS, marks
    # only the header was fetched, with a range request: nothing was downloaded in full
    gets = [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    assert gets and all(r[2].startswith("bytes=0-") for r in gets)
    local = read_local_header(tmp_path / "Tiny-Llama-Q8_0.gguf")
    shape = fit.shape_from_header(local, "Tiny-Llama-Q8_0.gguf")
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.head_dim, shape.vocab) == (2, 32, 2, 8, 64)
    assert shape.stored_bytes == shape.params * 4  # F32 tensors


def test_the_shape_equals_the_ledgers_own_reading_of_the_embedded_model():
    from engine.ledger import ModelShape
    from engine.model.default import default_model_path

    path = default_model_path()
    assert fit.shape_from_header(read_local_header(path), path.name) == ModelShape.from_path(path)


def test_marks_fits_window_more_memory_and_unsupported(hub, tmp_path):
    big_context = write_gguf(tmp_path / "Long-Q8_0.gguf", context=1 << 20, kv_heads=4).read_bytes()
    mamba = write_gguf(tmp_path / "Other-Q4_0.gguf", arch="mamba").read_bytes()
    hub.add(Repo("test-org/Long-GGUF", {"Long-Q8_0.gguf": big_context}))
    hub.add(Repo("test-org/Mamba-GGUF", {"Other-Q4_0.gguf": mamba}, architecture="mamba"))
    long_file = libhub.list_files("test-org/Long-GGUF")[0]
    # 1M tokens of KV (256 MiB) do not fit beside the 1 GiB headroom in 1,100 MiB; a window does
    windowed = fit.mark_hub_file(long_file, vram_mib=1100, ram_mib=8000)
    assert windowed.mark == fit.FITS_WINDOW and windowed.kv_window in fit.WINDOWS
    assert windowed.context >= 1 << 20 and "--kv-window" in windowed.detail
    assert fit.mark_hub_file(long_file, vram_mib=4000, ram_mib=8000).mark == fit.FITS
    short = fit.mark_hub_file(long_file, vram_mib=500, ram_mib=8000)
    assert short.mark == fit.NEEDS_MORE and "GiB" in short.detail and "VRAM" in short.detail
    requests_before = len(hub.requests)
    unsupported = fit.mark_hub_file(libhub.list_files("test-org/Mamba-GGUF")[0], vram_mib=0, ram_mib=8000)
    assert unsupported.mark == fit.UNSUPPORTED and "mamba" in unsupported.detail
    # the hub's architecture alone marks it: no header fetched (the listing itself made its two calls)
    assert not [r for r in hub.requests[requests_before:] if "/resolve/" in r[1]]


def test_settings_change_the_mark(hub, tmp_path):
    data = write_gguf(tmp_path / "Long-Q8_0.gguf", context=1 << 20, kv_heads=4).read_bytes()
    hub.add(Repo("test-org/Long-GGUF", {"Long-Q8_0.gguf": data}))
    f = libhub.list_files("test-org/Long-GGUF")[0]
    assert fit.mark_hub_file(f, vram_mib=1100, ram_mib=8000, settings={"max_context": 8192}).mark == fit.FITS


def test_offline_search_says_so(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(libhub.OfflineError, match="offline mode is on") as e:
        libhub.search("llama")
    assert "HF_HUB_OFFLINE" in e.value.remedy


def test_a_missing_repository_is_named(hub):
    with pytest.raises(libhub.LibraryError, match="no such repository"):
        libhub.list_files("nobody/nothing")


def test_an_unreachable_hub_is_a_clear_error(hf_home, monkeypatch):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)  # the client's retry back-off
    with pytest.raises(libhub.OfflineError, match="cannot be reached"):
        libhub.list_files("test-org/Tiny-Llama-GGUF")


def test_the_embedded_model_on_the_hub_is_marked_as_the_ledger_marks_the_file(hub):
    from engine.ledger import ModelShape
    from engine.model.default import default_model_path

    path = default_model_path()
    hub.add(Repo("test-org/SmolLM2-135M-Instruct-GGUF", {path.name: path.read_bytes()}))
    f = libhub.list_files("test-org/SmolLM2-135M-Instruct-GGUF")[0]
    assert f.quant == "Q4_1"
    shape = ModelShape.from_path(path)
    for vram in (0, 400, 2000):
        remote = fit.mark_hub_file(f, vram_mib=vram, ram_mib=8000)
        assert remote == fit.mark_shape(shape, vram_mib=vram, ram_mib=8000)
    assert remote.mark == fit.FITS
    fetched = sum(1 for r in hub.requests if "/resolve/" in r[1])
    assert fetched == 3  # one header fetch (a range request) per mark, never the whole file


def test_the_window_offered_is_the_largest_that_stays_on_the_gpu():
    from engine.ledger import ModelShape

    shape = ModelShape.synthetic("qwen3.5-27b-like")  # 262,144 tokens of context
    settings = {"weight_dtype": "ternary", "kv_dtype": "k8v4"}
    marks = {v: fit.mark_shape(shape, vram_mib=v, ram_mib=65536, settings=settings) for v in (9000, 9500, 12288)}
    assert [marks[v].kv_window for v in (9000, 9500, 12288)] == [8192, 16384, 32768]
    assert all(m.mark == fit.FITS_WINDOW and m.context >= 262_144 for m in marks.values())
    assert "the last 8,192 on the GPU" in marks[9000].detail and "--host-kv-mib" in marks[9000].detail
    assert fit.mark_shape(shape, vram_mib=12288, ram_mib=65536).mark == fit.NEEDS_MORE  # bf16 weights: 50 GiB
