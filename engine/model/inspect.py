"""What a model file or folder is, from its metadata alone (no weight is read): its kind, the engine's config when
the engine runs its architecture (else the dimensions the memory ledger sizes it by), its parameters, the bytes and
formats its weights are stored in and its MTP layers. The launcher's estimate and the memory ledger
(``ModelShape.from_info``) both start here, so neither reads a GGUF header or a config.json of its own."""
from __future__ import annotations

import json
import math
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    kind: str  # "gguf" | "hf"
    file_bytes: int  # on disk: the file, or the folder's files
    name: str
    config: Any = None  # engine.model.config.ModelConfig, for an architecture the engine runs
    params: int = 0  # of the text model, without the MTP layers (0: unknown, counted from the config)
    stored_bytes: int = 0  # the weights of those parameters, as stored
    stored_format: str = ""  # e.g. "GGUF Q4_K/Q6_K" or "safetensors BF16"
    mtp_layers: int = 0
    dims: dict[str, Any] = field(default_factory=dict)  # without a config: layers, heads, ... (ModelShape's names)
    linear: tuple[int, ...] | None = None  # without a config, a hybrid's linear-attention layers: (layers, v heads,
    # k head dim, v head dim, conv dim, conv kernel)


_CACHE: dict[tuple, ModelInfo] = {}
_READING: dict[tuple, threading.Lock] = {}  # one reader per file at a time: the others wait for its answer
_LOCK = threading.Lock()


def inspect(path: str | Path | None) -> ModelInfo:
    """The metadata of a model path (None: the embedded model); ModelLoadError with a remedy when the path is not a
    usable model. Cached by path, size and modification time."""
    from engine.model.loader import resolve_model_path

    p = resolve_model_path(str(path) if path else None)
    stat = p.stat()
    key = (str(p), stat.st_mtime_ns, stat.st_size)
    with _LOCK:
        reading = _READING.setdefault(key, threading.Lock())
    with reading:  # a GGUF's header takes seconds to parse (its vocabulary): checks made at once read it once
        if key not in _CACHE:
            _CACHE[key] = _folder_info(p) if p.is_dir() else _gguf_info(p)
    return _CACHE[key]


def _check_magic(path: Path) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return
    if path.suffix.lower() == ".gguf":
        raise ModelLoadError(f"{path.name} is not a readable GGUF file: it does not start with the GGUF header "
                             f"(it may be incomplete or damaged).", "Download it again, or pick another model.")
    raise ModelLoadError(f"{path.name} is neither a GGUF file nor a model folder.",
                         "Pick a .gguf file, or a folder with config.json and *.safetensors.")


def _gguf_block(name: str) -> int:
    """The block a GGUF tensor belongs to (blk.N.*), -1 for the others (embeddings, output)."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else -1


def _gguf_info(path: Path) -> ModelInfo:
    from engine.model.config import GGUF_ARCHS, GGUF_HYBRID_ARCHS, GGUF_MOE_ARCHS
    from engine.model.gguf_file import _field, open_gguf, read_config

    _check_magic(path)
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    size = path.stat().st_size

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    if arch in GGUF_ARCHS + GGUF_HYBRID_ARCHS or arch in GGUF_MOE_ARCHS:
        # the engine's own reader (MoE files are refused as the engine refuses them); the weights count the main
        # model, the MTP blocks llama.cpp appends (blk.{layers}.nextn.*) are the MTP layers
        cfg = read_config(reader, path)
        main = [t for t in reader.tensors if _gguf_block(t.name) < cfg.num_layers]
        return ModelInfo(path, "gguf", size, cfg.name or cfg.arch, cfg, sum(int(t.n_elements) for t in main),
                         sum(int(t.n_bytes) for t in main), _gguf_format(main),
                         int(get("nextn_predict_layers", 0) or 0))
    layers, hidden = get("block_count"), get("embedding_length")
    if not layers or not hidden:
        raise ModelLoadError(f"{path.name}: architecture '{arch}' has no block_count/embedding_length metadata.",
                             "The file was converted by an incompatible tool; convert it again.")
    heads = get("attention.head_count", 0) or 0
    heads = int(max(heads) if isinstance(heads, (list, tuple)) else heads)
    kv = get("attention.head_count_kv", heads)
    interval = int(get("full_attention_interval", 0) or 0)
    if isinstance(kv, (list, tuple)):  # llama.cpp hybrids: 0 KV heads on recurrent layers
        full, kv_heads = sum(1 for n in kv if n), max(kv)
    else:
        full, kv_heads = (int(layers) // interval if interval else int(layers)), int(kv)
    linear = None
    if full < int(layers):
        v_heads, k_heads = int(get("ssm.time_step_rank", 0)), int(get("ssm.group_count", 0))
        k_dim, inner = int(get("ssm.state_size", 0)), int(get("ssm.inner_size", 0))
        linear = (int(layers) - full, v_heads, k_dim, inner // v_heads if v_heads else 0,
                  2 * k_heads * k_dim + inner, int(get("ssm.conv_kernel", 4)))
    ff = get("feed_forward_length", 0)
    dims = dict(layers=int(layers), full_attention_layers=full, kv_heads=kv_heads,
                head_dim=int(get("attention.key_length", int(hidden) // max(heads, 1))), hidden=int(hidden),
                vocab=int(get("vocab_size", 0) or len(_field(reader, "tokenizer.ggml.tokens", []) or [])),
                heads=heads, intermediate=int(max(ff) if isinstance(ff, list) else ff or 0),
                max_position=int(get("context_length", 4096)))
    return ModelInfo(path, "gguf", size, str(_field(reader, "general.name", path.stem)), None,
                     sum(int(t.n_elements) for t in reader.tensors), sum(int(t.n_bytes) for t in reader.tensors),
                     _gguf_format(reader.tensors), int(get("nextn_predict_layers", 0) or 0), dims, linear)


def _gguf_format(tensors) -> str:
    return f"GGUF {'/'.join(sorted({t.tensor_type.name for t in tensors}))}"


@dataclass(frozen=True)
class _Totals:
    params: int = 0
    stored: int = 0
    dtypes: str = ""
    mtp_layers: int = 0
    files: int = 0
    bytes_on_disk: int = 0


def _safetensors_totals(folder: Path) -> _Totals:
    """The text model's parameters, bytes and dtypes from the safetensors headers, without reading any tensor: the
    vision tower of a multimodal checkpoint is never loaded, and the MTP layers (mtp.*) are counted apart."""
    from engine.model.config import VISION_PREFIX

    params = stored = 0
    dtypes: set[str] = set()
    mtp: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name == "__metadata__" or name.startswith(VISION_PREFIX):
                continue
            if name.startswith("mtp."):
                if name.startswith("mtp.layers."):
                    mtp.add(name.split(".")[2])
                continue
            params += math.prod(int(d) for d in entry.get("shape", []))
            start, end = entry.get("data_offsets", (0, 0))
            stored += int(end) - int(start)
            dtypes.add(str(entry.get("dtype", "?")))
    on_disk = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return _Totals(params, stored, "/".join(sorted(dtypes)), len(mtp), len(files), on_disk)


def _folder_info(folder: Path) -> ModelInfo:
    try:
        totals = _safetensors_totals(folder)
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{folder}: a safetensors header cannot be read ({e}).",
                             "The file is truncated or damaged; download it again.") from None
    fmt = f"safetensors {totals.dtypes}" if totals.dtypes else ""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json cannot be read ({e}).",
                             "Pass a GGUF file or a Hugging Face model folder (config.json + *.safetensors).") from None
    from engine.model.config import HF_ARCHS

    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw  # multimodal: nested
    if any(a in HF_ARCHS or "Moe" in a for a in raw.get("architectures") or []):
        from engine.model.hf_folder import read_config  # the engine's reader: MoE models refused as it refuses them

        cfg = read_config(folder)
        # MTP layers: those the weights hold; without weights (a config.json alone), what the config says
        mtp = totals.mtp_layers if totals.files else int(text.get("mtp_num_hidden_layers") or 0)
        return ModelInfo(folder, "hf", totals.bytes_on_disk, cfg.name or cfg.arch, cfg, totals.params,
                         totals.stored, fmt, mtp)
    dims, linear = _config_dims(folder, text)
    params = totals.params
    if not params:  # no weights here: estimate like a llama-style model
        h, inter = dims["hidden"], dims["intermediate"]
        params = 2 * dims["vocab"] * h + dims["layers"] * (4 * h * dims["heads"] * dims["head_dim"]
                                                          + 3 * h * (inter or 3 * h))
    return ModelInfo(folder, "hf", totals.bytes_on_disk, folder.name, None, params, totals.stored, fmt,
                     int(text.get("mtp_num_hidden_layers") or 0), dims, linear)


def _config_dims(folder: Path, text: dict) -> tuple[dict[str, Any], tuple[int, ...] | None]:
    try:
        layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        types = text.get("layer_types") or []
        interval = int(text.get("full_attention_interval") or 0)
        if types:
            full = sum(1 for t in types if t == "full_attention")
        else:
            full = layers // interval if interval and "linear_num_value_heads" in text else layers
        linear = None
        if full < layers:
            kh, vh = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
            kd, vd = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
            linear = (layers - full, vh, kd, vd, 2 * kh * kd + vh * vd, int(text.get("linear_conv_kernel_dim", 4)))
        dims = dict(layers=layers, full_attention_layers=full, kv_heads=int(text.get("num_key_value_heads") or heads),
                    head_dim=int(text.get("head_dim") or hidden // heads), hidden=hidden,
                    vocab=int(text["vocab_size"]), heads=heads, intermediate=int(text.get("intermediate_size") or 0),
                    max_position=int(text.get("max_position_embeddings", 4096)))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: field {e} is missing or malformed.",
                             "Download the model folder again.") from None
    return dims, linear


def runnable(info: ModelInfo) -> ModelInfo:
    """``info`` when the engine runs its architecture, else the engine reader's ModelLoadError saying why not."""
    if info.config is None:
        if info.kind == "gguf":
            from engine.model.gguf_file import open_gguf, read_config

            read_config(open_gguf(info.path), info.path)
        else:
            from engine.model.hf_folder import read_config

            read_config(info.path)
        raise ModelLoadError(f"{info.path.name}: the engine does not run this model's architecture.",
                             "Pick a model of an architecture the engine runs (docs/MODELS.md).")
    return info
