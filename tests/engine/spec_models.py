"""Tiny checkpoints for the speculative-decoding tests: a target, a draft with the same tokenizer, a draft with
another one, and targets carrying MTP layers in the Qwen3-Next and DeepSeek-V3 layouts."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engine.helpers import add_tokenizer, tiny_hf_model

VOCAB = 512


def tiny_folder(root: Path, name: str, seed: int, vocab: int = VOCAB, **overrides) -> Path:
    _, folder = tiny_hf_model("llama", root, seed=seed, name=name, vocab_size=vocab, **overrides)
    add_tokenizer(folder, vocab)
    return folder


def add_mtp(folder: Path, layout: str, seed: int = 7) -> Path:
    """Adds one random MTP layer (a copy of layer 0's shapes) to a tiny llama folder, in the given layout."""
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    cfg = json.loads((folder / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    layer0 = {n.removeprefix("model.layers.0."): t for n, t in tensors.items() if n.startswith("model.layers.0.")}
    body = {n: (1.0 + 0.2 * torch.randn(t.shape, generator=g)) if n.endswith("norm.weight")
            else 0.1 * torch.randn(t.shape, generator=g) for n, t in layer0.items()}
    norm = lambda: 1.0 + 0.2 * torch.randn(hidden, generator=g)  # noqa: E731
    fc = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    if layout == "qwen3-next":
        extra = {"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": norm(),
                 "mtp.pre_fc_norm_hidden.weight": norm(), "mtp.norm.weight": norm(),
                 **{f"mtp.layers.0.{n}": t for n, t in body.items()}}
    else:
        p = f"model.layers.{layers}."
        extra = {p + "eh_proj.weight": fc, p + "enorm.weight": norm(), p + "hnorm.weight": norm(),
                 p + "shared_head.norm.weight": norm(), **{p + n: t for n, t in body.items()}}
        cfg["num_nextn_predict_layers"] = 1
        (folder / "config.json").write_text(json.dumps(cfg))
    save_file({**tensors, **{n: t.contiguous() for n, t in extra.items()}}, str(files[0]))
    for f in files[1:]:
        f.unlink()
    return folder


def swap_tokenizer_ids(folder: Path) -> Path:
    """Rewrites the folder's tokenizer so that two words trade ids: same size, other mapping."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["w2"], vocab["w3"] = vocab["w3"], vocab["w2"]
    path.write_text(json.dumps(data))
    return folder


def add_tensors(folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    """Writes `extra` into a checkpoint folder's weights (all in its first safetensors file), e.g. MTP tensors that
    transformers leaves out of a model it saves."""
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    save_file({**tensors, **{n: t.contiguous() for n, t in extra.items()}}, str(files[0]))
    for f in files[1:]:
        f.unlink()
    return folder
