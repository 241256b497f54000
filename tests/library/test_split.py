"""llama.cpp's split GGUF files (-00001-of-0000N.gguf): listed as one model, marked from every part's header,
downloaded whole, merged into one file the engine loads (its tensors and metadata checked against the same model
written unsplit, read back with the gguf package), found in the cache and in folders, removed whole."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from engine.library import download as dl, hub as libhub, local, split
from engine.library.fit import FITS, mark_hub_file
from engine.library.resolve import resolve_hf
from tests.library.conftest import Repo, write_gguf

REPO = "test-org/Tiny-Split-GGUF"


def _fields(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("GGUF.", "split."))}


def _same_model(merged, whole) -> None:
    a, b = GGUFReader(merged), GGUFReader(whole)
    assert _fields(a) == _fields(b)
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in a.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name


@pytest.fixture
def split_repo(hub, tmp_path):
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    first = write_gguf(parts_dir / "Tiny-Split-Q8_0.gguf", split_max_tensors=8, pad_mib=1)
    parts = sorted(parts_dir.glob("*.gguf"))
    assert first == parts[0] and len(parts) == 3
    (tmp_path / "whole").mkdir()
    whole = write_gguf(tmp_path / "whole" / "Tiny-Split-Q8_0.gguf", pad_mib=1)  # the same model, unsplit
    repo = hub.add(Repo(REPO, {p.name: p.read_bytes() for p in parts}))
    return repo, parts, whole


def test_a_split_model_is_listed_marked_downloaded_merged_listed_and_removed_as_one(split_repo, hf_home):
    repo, parts, whole = split_repo
    files = libhub.list_files(REPO)
    assert len(files) == 1
    f = files[0]
    assert f.filename == parts[0].name and f.quant == "Q8_0" and [p.filename for p in f.parts] == [p.name for p in parts]
    assert f.size == sum(p.stat().st_size for p in parts)
    mark = mark_hub_file(f, vram_mib=0, ram_mib=16384)
    assert mark.mark == FITS, str(mark)
    reports = []
    path = dl.download(f, on_progress=reports.append)
    assert [r.done for r in reports] == sorted(r.done for r in reports) and reports[-1].done == reports[-1].total == f.size
    assert path.name == "Tiny-Split-Q8_0.gguf" and path.is_relative_to(hf_home / "ninfer-merged")
    _same_model(path, whole)
    assert resolve_hf(f"hf:{REPO}:Q8_0") == path == resolve_hf(f"hf:{REPO}:Q8_0", download_missing=False)

    listed = local.hf_cache_models()
    assert [m.name for m in listed] == [f"{REPO}/Tiny-Split-Q8_0.gguf"]
    m = listed[0]
    assert m.supported and m.size == f.size and len(m.parts) == 3 and m.model_arg == f"hf:{REPO}:Q8_0"
    assert m.parameters == sum(int(np.prod(t.shape)) for t in GGUFReader(whole).tensors)
    merged_size = path.stat().st_size
    assert local.remove(m) == f.size + merged_size  # every part's blob, and the merged file
    assert not path.exists() and local.hf_cache_models() == []
    assert not list((hf_home / "hub").rglob("blobs/*"))


def test_a_folder_split_model_loads_by_any_part_and_a_missing_part_is_named(tmp_path, hf_home, monkeypatch):
    from engine.library import usage
    from engine.library.hub import LibraryError
    from engine.model.loader import resolve_model_path

    monkeypatch.setenv("NINFER_HOME", str(tmp_path / "ninfer-home"))

    folder = tmp_path / "models"
    folder.mkdir()
    write_gguf(folder / "Mine-Q8_0.gguf", split_max_tensors=8)
    (tmp_path / "whole").mkdir()
    whole = write_gguf(tmp_path / "whole" / "Mine-Q8_0.gguf")
    listed = local.folder_models(folder)
    assert [(m.name, len(m.parts)) for m in listed] == [("Mine-Q8_0.gguf", 3)]
    merged = resolve_model_path(str(folder / "Mine-Q8_0-00002-of-00003.gguf"))
    _same_model(merged, whole)
    assert resolve_model_path(str(listed[0].path)) == merged  # merged once
    assert listed[0].last_used is None
    usage.record(merged, when=1234.0)  # what loading it records
    assert listed[0].last_used == 1234.0
    (folder / "Mine-Q8_0-00003-of-00003.gguf").unlink()
    with pytest.raises(LibraryError, match="Mine-Q8_0-00003-of-00003.gguf is missing"):
        split.sibling_parts(folder / "Mine-Q8_0-00001-of-00003.gguf")
    broken = local.folder_models(folder)
    assert len(broken) == 1 and not broken[0].supported and "missing" in broken[0].problem


def _write_split(source, first, max_tensors: int) -> None:
    """``source`` split the way llama.cpp's gguf-split does, by the gguf package's writer (first: part 1's path
    without the -00001-of-0000N suffix)."""
    from gguf import GGUFValueType, GGUFWriter

    r = GGUFReader(source)
    w = GGUFWriter(first, r.fields["general.architecture"].contents(), split_max_tensors=max_tensors)
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            w.add_key_value(k, f.contents(), f.types[0],
                            sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()


@pytest.mark.slow
def test_the_embedded_model_split_in_three_loads_and_answers(hub, hf_home, tmp_path):
    """The embedded model, published split in three parts, fetched by its hf: reference, loaded by the engine's
    builder from the merged file and answering."""
    from engine.build import build_engine
    from engine.model.default import default_model_path
    from engine.sampling import SamplingParams

    source = default_model_path()
    _write_split(source, tmp_path / "SmolLM2-135M-Instruct-Q4_1.gguf", max_tensors=120)
    parts = sorted(tmp_path.glob("SmolLM2-135M-Instruct-Q4_1-*-of-*.gguf"))
    assert len(parts) == 3
    hub.add(Repo("test-org/SmolLM2-Split-GGUF", {p.name: p.read_bytes() for p in parts}))
    loaded = build_engine("hf:test-org/SmolLM2-Split-GGUF:Q4_1", device="cpu", max_context=512, max_concurrency=1)
    try:
        assert loaded.path.is_relative_to(hf_home / "ninfer-merged")
        assert loaded.path.name == "SmolLM2-135M-Instruct-Q4_1.gguf"
        tok = loaded.tokenizer
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        out = loaded.engine.start().generate(prompt, SamplingParams(temperature=0, max_tokens=48))
        assert "Paris" in tok.decode(out)
    finally:
        loaded.engine.shutdown()
