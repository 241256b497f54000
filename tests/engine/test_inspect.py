"""engine.model.inspect: a model's metadata without its weights, the one reading the launcher's estimate and the
memory ledger both start from."""
import pytest

from engine.errors import ModelLoadError
from engine.ledger import ModelShape
from engine.model.default import default_model_path
from engine.model.inspect import inspect, runnable
from tests.library.conftest import write_gguf


def test_the_embedded_model_is_read_from_its_header_with_its_config():
    info = inspect(None)
    assert info.kind == "gguf" and info.path == default_model_path() and info.config is not None
    assert info.file_bytes == default_model_path().stat().st_size
    assert info.config.num_layers == 30 and info.config.hidden_size == 576  # SmolLM2-135M
    assert 134e6 < info.params < 136e6 and 0 < info.stored_bytes < info.file_bytes
    assert inspect(str(default_model_path())) is info  # cached by path, size and modification time
    shape = ModelShape.from_info(info)
    assert shape == ModelShape.from_path(None) and shape.params == info.params and shape.source == "gguf"


def test_an_architecture_the_engine_does_not_run_is_sized_from_its_dimensions(tmp_path):
    path = write_gguf(tmp_path / "other.gguf", "falcon", layers=3, hidden=64, heads=4, kv_heads=2)
    info = inspect(path)
    assert info.config is None and info.name == "other"
    assert info.dims["layers"] == 3 and info.dims["kv_heads"] == 2 and info.dims["head_dim"] == 16
    shape = ModelShape.from_info(info)
    assert (shape.layers, shape.hidden, shape.vocab, shape.params) == (3, 64, 64, info.params)
    with pytest.raises(ModelLoadError):
        runnable(info)


@pytest.mark.parametrize("name, start, problem", [("broken.gguf", b"GGUX", "does not start with the GGUF header"),
                                                  ("notes.bin", b"hello", "neither a GGUF file nor a model folder")])
def test_a_file_that_is_no_model_is_named_as_such(tmp_path, name, start, problem):
    path = tmp_path / name
    path.write_bytes(start + b"\0" * 64)
    with pytest.raises(ModelLoadError, match=problem):
        inspect(path)
