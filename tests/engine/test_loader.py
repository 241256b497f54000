"""Loading: GGUF files and HF folders give the same model; damaged or unsupported inputs fail with a clear
ModelLoadError; non-ASCII paths work; progress and cancellation."""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError, NInferError
from engine.model.default import default_model_path
from engine.model.loader import load_weights
from engine.model.weights import LoadCancelled
from engine.sampling import SamplingParams
from tests.engine.helpers import (add_tokenizer, hf_greedy, hf_logits, make_runner, rel_err, runner_logits,
                                  write_tiny_gguf)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
SUPPORTED_GGUF = "llama, qwen2, qwen3"


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny[0], tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def load_error(path, **kw) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_weights(path, **kw)
    return str(info.value)


# ----- the same weights through GGUF and through an HF folder -----


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "llama-tied", "llama-rope3"])
def test_gguf_gives_the_logits_of_the_hf_folder(tiny_models, tmp_path, variant):
    """A GGUF written like llama.cpp's converter writes it (Llama q/k rows permuted for interleaved RoPE, llama3
    scaling as rope_freqs factors) loads into the same tensors and logits as the HF folder."""
    hf, folder = tiny_models(variant)
    path = write_tiny_gguf(hf, tmp_path / f"{variant}.gguf")
    _, from_gguf = load_weights(path)
    _, from_hf = load_weights(folder)
    assert from_gguf.source_format == "gguf" and from_hf.source_format == "hf"
    assert set(from_gguf.storage.values()) == {"F32"}
    for name, t in from_hf.tensors.items():
        assert torch.equal(from_gguf.tensors[name], t), name
    a, b = from_gguf.config, from_hf.config
    for field in ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "rope_theta", "tie_embeddings", "attention_bias", "qk_norm", "max_position"):
        assert getattr(a, field) == getattr(b, field), field
    assert abs(a.rms_eps - b.rms_eps) < 1e-9
    prompt = [int(i) for i in np.random.default_rng(3).integers(0, 512, 150)]
    ours = runner_logits(make_runner(path, 4), prompt)
    assert rel_err(ours, hf_logits(hf, prompt)) <= TOL


def test_build_engine_on_an_hf_folder(tiny_models, tmp_path):
    from engine.build import build_engine

    # (a llama: transformers replaces the word-level test tokenizer by its own BPE class for qwen2/qwen3 folders)
    hf, folder = tiny_models("llama-tied")
    local = tmp_path / "llama-with-tokenizer"
    shutil.copytree(folder, local)
    add_tokenizer(local, hf.config.vocab_size)
    loaded = build_engine(local, max_context=256, max_concurrency=2)
    assert loaded.config.arch == "llama" and loaded.config.tie_embeddings and loaded.dtype == torch.float32
    assert loaded.engine.max_context == 256 and 1 in loaded.engine.eos_ids
    prompt = loaded.tokenizer.encode("w5 w17 w300 w42 w42 w9")
    assert prompt == [5, 17, 300, 42, 42, 9]
    loaded.engine.start()
    try:
        out = loaded.engine.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    finally:
        loaded.engine.shutdown()
    assert out == hf_greedy(hf, prompt, 20)


# ----- errors -----


def test_missing_model_path(tmp_path):
    from engine.build import build_engine

    missing = tmp_path / "no-such-model.gguf"
    msg = load_error(missing)
    assert "not found" in msg and "no-such-model.gguf" in msg
    with pytest.raises(ModelLoadError, match="not found"):
        build_engine(missing)


def test_truncated_gguf(tmp_path):
    src = default_model_path()
    size = src.stat().st_size
    with open(src, "rb") as f:
        data = f.read(size // 2)
    for n in (size // 2, 1000):
        path = tmp_path / f"cut-{n}.gguf"
        path.write_bytes(data[:n])
        msg = load_error(path)
        assert path.name in msg and "truncated or damaged" in msg, msg


def test_gguf_with_a_short_header(tmp_path):
    for i, blob in enumerate([b"GGUF\x03\x00", b"GGUF", b"GGUF\x03\x00\x00\x00\x05"]):
        path = tmp_path / f"short{i}.gguf"
        path.write_bytes(blob)
        msg = load_error(path)
        assert "not a readable GGUF file" in msg and path.name in msg


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    msg = load_error(path)
    assert "neither a GGUF file nor a model folder" in msg


def _tensor_offset_position(path: Path, index: int) -> int:
    """Where in the file the data offset of tensor `index`'s info record is stored."""
    field = gguf.GGUFReader(path).tensors[index].field
    return field.offset + sum(p.nbytes for p in field.parts[:-1])


def test_gguf_with_a_bad_tensor_offset(tiny_gguf, tmp_path):
    blob = bytearray(tiny_gguf.read_bytes())
    data_size = len(blob) - gguf.GGUFReader(tiny_gguf).data_offset
    # the last tensor's data far past the end; the first one's starting 96 bytes before the end
    for index, offset in ((-1, len(blob) * 2), (0, data_size - 96)):
        pos = _tensor_offset_position(tiny_gguf, index)
        bad = bytearray(blob)
        bad[pos:pos + 8] = np.array([offset], dtype="<u8").tobytes()
        path = tmp_path / f"bad-offset{index}.gguf"
        path.write_bytes(bytes(bad))
        msg = load_error(path)
        assert path.name in msg and "truncated or damaged" in msg, msg
    # tensor data cut short at the end of the file
    path = tmp_path / "short-data.gguf"
    path.write_bytes(bytes(blob[:-64]))
    assert "truncated or damaged" in load_error(path)


@pytest.mark.parametrize("gguf_name,hf_name,shape", [
    ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight", (100, 64)),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", (60, 64)),  # rows not a multiple of heads
    ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", (32, 48)),
    ("token_embd.weight", "model.embed_tokens.weight", (512, 32)),
])
def test_gguf_with_a_wrong_tensor_shape(tiny, tmp_path, gguf_name, hf_name, shape):
    path = write_tiny_gguf(tiny[0], tmp_path / "wrong-shape.gguf",
                           overrides={gguf_name: np.zeros(shape, dtype=np.float32)})
    msg = load_error(path)
    assert hf_name in msg and f"shape {shape}" in msg and "wrong-shape.gguf" in msg, msg


def test_gguf_with_a_missing_tensor(tiny, tmp_path):
    path = write_tiny_gguf(tiny[0], tmp_path / "missing.gguf", skip=("blk.1.ffn_down.weight",))
    assert "missing model.layers.1.mlp.down_proj.weight" in load_error(path)


def test_hf_folder_with_a_wrong_tensor_shape(tiny, tmp_path):
    folder = tmp_path / "wrong-shape"
    shutil.copytree(tiny[1], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, folder / "model.safetensors")
    msg = load_error(folder)
    assert "model.layers.1.self_attn.k_proj.weight has shape (16, 64), expected (32, 64)" in msg, msg


def test_hf_config_that_disagrees_with_the_tensors(tiny, tmp_path):
    folder = tmp_path / "bad-config"
    shutil.copytree(tiny[1], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    msg = load_error(folder)
    assert "mlp.gate_proj.weight has shape (128, 64), expected (96, 64)" in msg, msg


def test_unsupported_gguf_architecture(tiny, tmp_path):
    path = write_tiny_gguf(tiny[0], tmp_path / "gemma.gguf", arch="gemma2")
    msg = load_error(path)
    assert "'gemma2' is not supported" in msg and SUPPORTED_GGUF in msg
    empty = tmp_path / "empty-gemma.gguf"
    w = gguf.GGUFWriter(str(empty), "gemma2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert SUPPORTED_GGUF in load_error(empty)


def test_unsupported_hf_architecture(tiny, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny[1], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(cfg))
    msg = load_error(folder)
    assert "GPT2LMHeadModel" in msg and "not supported" in msg
    assert all(name in msg for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))


def test_hf_folder_problems(tiny, tmp_path):
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny[1] / "config.json", no_weights)
    (no_weights / "pytorch_model.bin").write_bytes(b"\0" * 16)
    msg = load_error(no_weights)
    assert "no *.safetensors files" in msg and "convert" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in load_error(empty)
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny[1], damaged)
    st = damaged / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    assert "cannot be opened" in load_error(damaged)
    bad_json = tmp_path / "bad-json"
    shutil.copytree(tiny[1], bad_json)
    (bad_json / "config.json").write_text("{not json")
    assert "config.json cannot be read" in load_error(bad_json)


def test_errors_are_ninfer_errors_with_a_remedy(tmp_path):
    with pytest.raises(NInferError) as info:
        load_weights(tmp_path / "missing.gguf")
    assert isinstance(info.value, ModelLoadError)
    assert info.value.problem and info.value.remedy


# ----- paths, progress, cancellation -----


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


@pytest.mark.slow
def test_default_model_from_a_non_ascii_path(tmp_path, default_fp32_engine):
    from engine.build import build_engine

    path = tmp_path / "模型" / "小模型.gguf"
    _link_or_copy(default_model_path(), path)
    loaded = build_engine(path, max_context=256, max_concurrency=1)
    assert loaded.path == path
    prompt = loaded.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    loaded.engine.start()
    try:
        out = loaded.engine.generate(prompt, params)
    finally:
        loaded.engine.shutdown()
    assert len(out) == 6
    assert out == default_fp32_engine.engine.generate(prompt, params)


def test_hf_folder_and_gguf_from_non_ascii_paths(tiny, tiny_gguf, tmp_path):
    folder = tmp_path / "模型" / "Ünïcødé folder"
    shutil.copytree(tiny[1], folder)
    _, w = load_weights(folder)
    gguf_path = tmp_path / "модель" / "小模型 ✓.gguf"
    _link_or_copy(tiny_gguf, gguf_path)
    _, g = load_weights(gguf_path)
    assert all(torch.equal(g.tensors[k], t) for k, t in w.tensors.items())


@pytest.mark.parametrize("which", ["gguf", "hf"])
def test_progress_reaches_one(tiny, tiny_gguf, which):
    path = tiny_gguf if which == "gguf" else tiny[1]
    seen: list[tuple[float, str]] = []
    load_weights(path, progress=lambda f, msg: seen.append((f, msg)))
    fractions = [f for f, _ in seen]
    assert len(fractions) >= 10
    assert all(0 < f <= 1 for f in fractions)
    assert all(b > a for a, b in zip(fractions, fractions[1:]))
    assert fractions[-1] == 1.0
    assert all(isinstance(msg, str) and msg for _, msg in seen)


@pytest.mark.parametrize("which", ["gguf", "hf"])
def test_cancel(tiny, tiny_gguf, which):
    path = tiny_gguf if which == "gguf" else tiny[1]
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadCancelled, match="cancelled"):
        load_weights(path, cancel=cancel)
    # cancelled half-way: loading stops at the next tensor
    cancel = threading.Event()
    seen = []

    def progress(f, _msg):
        seen.append(f)
        if len(seen) == 3:
            cancel.set()

    with pytest.raises(LoadCancelled):
        load_weights(path, progress=progress, cancel=cancel)
    assert len(seen) == 3 and seen[-1] < 1.0
    assert isinstance(LoadCancelled(), NInferError)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need a POSIX system")
@pytest.mark.parametrize("name", ["model.gguf", "model.bin"])
def test_a_named_pipe_is_refused_at_once_not_read(tmp_path, name):
    pipe = tmp_path / name
    os.mkfifo(pipe)
    outcome = []

    def load():
        try:
            load_weights(pipe)
        except Exception as e:  # noqa: BLE001 (the test reports whatever came)
            outcome.append(e)

    worker = threading.Thread(target=load, daemon=True)  # on failure, a reader blocked on the pipe is left behind
    worker.start()
    worker.join(5)
    assert outcome, "loading a named pipe did not return within 5 s"
    assert isinstance(outcome[0], ModelLoadError), outcome
    assert "not a regular file" in str(outcome[0]) and "named pipe" in str(outcome[0]) and ".gguf" in str(outcome[0])

