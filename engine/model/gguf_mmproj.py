"""The vision tower of a GGUF model from llama.cpp's mmproj file: a separate GGUF of architecture `clip` with
`clip.projector_type` qwen3vl_merger (Qwen3-VL, Qwen3.5, Qwen3.5-MoE; llama.cpp's conversion/qwen3vl.py), read into
the tensors and config engine/model/vision.py's VisionTower takes, and the image processor from its keys.

How the converter stores the HF tower (`model.visual.*`), and what this reads back:
- the Conv3d patch embedding [C, 3, 2, P, P] split along its temporal axis into v.patch_embd.weight (slice 0) and
  v.patch_embd.weight.1 (slice 1), each [C, 3, P, P] (clip.cpp's qwen3vl graph convolves each and sums them), its
  bias v.patch_embd.bias (an image repeats its frame over both slices, so only video would show a swap);
- every other tensor under the gguf package's MMPROJ name map, values and (row-major) layout unchanged: the fused
  qkv stays fused (rows q | k | v), nothing transposed;
- the merger: norm -> v.post_ln, linear_fc1 -> mm.0, linear_fc2 -> mm.2;
- keys clip.vision.{embedding_length, feed_forward_length, block_count, attention.head_count, patch_size,
  spatial_merge_size, projection_dim (the text model's hidden size), image_mean, image_std}.
What the file does not carry, and is taken from the Qwen3.5 tower instead: the activation (the converter writes
use_gelu for every qwen3vl_merger file; HF's is gelu_pytorch_tanh), the rotary theta (HF's 10000; what clip.cpp
uses was not checked), the
LayerNorm epsilon (the file's is the text model's rms_norm_eps; HF's tower fixes 1e-6), the temporal patch (2: the
converter refuses any other), and the pixel bounds where clip.vision.image_min_pixels / image_max_pixels are absent
(Qwen3.5's published preprocessor_config.json: 65,536 to 16,777,216 pixels). Read from llama.cpp's
conversion/qwen3vl.py (Qwen3VLVisionModel) and conversion/base.py (MmprojModel.set_gguf_parameters)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.errors import ModelLoadError, NInferError
from engine.library.mmproj import mmproj_beside
from engine.model.gguf_file import _field, open_gguf
from engine.model.image_processing import CLIP_MEAN, CLIP_STD, ImageProcessorConfig
from engine.model.vision import VisionConfig, VisionTower, vision_shapes

log = logging.getLogger("ninfer.model")

PROJECTOR = "qwen3vl_merger"
IMAGE_TOKEN = "<|image_pad|>"
PUBLISHED_MIN_PIXELS, PUBLISHED_MAX_PIXELS = 65536, 16777216  # Qwen3.5's preprocessor_config.json `size`
PATCH_SLICES = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # the Conv3d's temporal slices 0 and 1
_GLOBAL = {"v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
           "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
           "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
           "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
_BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
          "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}


class MmprojError(NInferError):
    """An mmproj file that cannot be this model's vision tower, or none to choose."""


class ForeignProjectorError(MmprojError):
    """A projector file of another kind (not a clip file, another projector, DeepStack): found beside a model rather
    than named, it leaves the model text-only, as other models' repositories ship such files (LLaVA, Gemma 3)."""


def hf_vision_name(gguf_name: str) -> str | None:
    """The tower's name (after model.visual.) of one mmproj tensor; None for the patch slices and unknown names."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in _BLOCK:
        return f"blocks.{parts[2]}.{_BLOCK[parts[3]]}.{parts[4]}"
    return None


def find_mmproj(model: Path, setting: str) -> Path | None:
    """The projector file of a GGUF model: `setting` where given (it must exist), else the one mmproj*.gguf beside
    the model file; None where there is none (the model serves text only)."""
    if setting:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise MmprojError(f"--mmproj {setting}: no such file.",
                              "Pass the path of the model's mmproj*.gguf file, or leave --mmproj empty to use the one "
                              "beside the model file.")
        return path
    found = mmproj_beside(model)
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise MmprojError(f"{model.parent} holds {len(found)} vision projector files ({names}) beside {model.name}, "
                          f"and which one to load is not clear.",
                          f"Choose one with --mmproj FILE (e.g. --mmproj {found[0]}).")
    return found[0] if found else None


def _key(reader, path: Path, key: str, default=None):
    value = _field(reader, key, default)
    if value is None:
        raise MmprojError(f"{path.name}: the key {key} is missing.",
                          "The file is not a complete mmproj file; convert it again with llama.cpp's "
                          "convert_hf_to_gguf.py --mmproj, or download the repository's mmproj file again.")
    return value


def _check_kind(reader, path: Path) -> None:
    arch = _field(reader, "general.architecture")
    projector = _field(reader, "clip.projector_type") or _field(reader, "clip.vision.projector_type")
    if arch != "clip" or not _field(reader, "clip.has_vision_encoder", False):
        raise ForeignProjectorError(
            f"{path.name} is not a vision projector file (architecture {arch!r}, has_vision_encoder "
            f"{_field(reader, 'clip.has_vision_encoder')}).",
            "Pass llama.cpp's mmproj*.gguf file of the model as --mmproj.")
    if projector != PROJECTOR:
        raise ForeignProjectorError(
            f"{path.name}: projector type {projector!r}; this engine runs the {PROJECTOR} projector "
            f"(Qwen3.5 / Qwen3.6) only.",
            "Use the mmproj file made for this Qwen3.5 / Qwen3.6 model, or serve it without images (leave --mmproj "
            "empty and move the file away from the model).")
    if any(_field(reader, "clip.vision.is_deepstack_layers", []) or []):
        raise ForeignProjectorError(
            f"{path.name}: the tower has DeepStack layers (a Qwen3-VL projector), which this engine does not run.",
            "Use a Qwen3.5 / Qwen3.6 model and its mmproj file.")


def read_vision_config(reader, path: Path, tensors: dict[str, np.ndarray]) -> VisionConfig:
    """The tower's config from the clip.vision.* keys (and the position table's and patch's shapes)."""
    v = "clip.vision."
    slice0 = tensors.get(PATCH_SLICES[0])
    table = tensors.get("v.position_embd.weight")
    if slice0 is None or table is None:
        missing = [n for n, t in ((PATCH_SLICES[0], slice0), ("v.position_embd.weight", table)) if t is None]
        raise _missing(path, missing)
    return VisionConfig(
        depth=int(_key(reader, path, v + "block_count")), hidden_size=int(_key(reader, path, v + "embedding_length")),
        num_heads=int(_key(reader, path, v + "attention.head_count")),
        intermediate_size=int(_key(reader, path, v + "feed_forward_length")),
        hidden_act="gelu_pytorch_tanh", in_channels=int(slice0.shape[1]),
        patch_size=int(_key(reader, path, v + "patch_size")), temporal_patch_size=len(PATCH_SLICES),
        spatial_merge_size=int(_field(reader, v + "spatial_merge_size", 2)),
        out_hidden_size=int(_key(reader, path, v + "projection_dim")), num_position_embeddings=int(table.shape[0]))


def read_processor(reader, cfg: VisionConfig) -> ImageProcessorConfig:
    """The image processor: patch and merge of the tower, mean / std of the file (the converter's fallback, CLIP's,
    where it has none), the pixel bounds of the file or else Qwen3.5's published ones."""
    v = "clip.vision."
    return ImageProcessorConfig(
        patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size, merge_size=cfg.spatial_merge_size,
        min_pixels=int(_field(reader, v + "image_min_pixels", 0) or PUBLISHED_MIN_PIXELS),
        max_pixels=int(_field(reader, v + "image_max_pixels", 0) or PUBLISHED_MAX_PIXELS),
        image_mean=tuple(float(m) for m in _field(reader, v + "image_mean", CLIP_MEAN)),
        image_std=tuple(float(s) for s in _field(reader, v + "image_std", CLIP_STD)))


def _missing(path: Path, names: list[str]) -> MmprojError:
    return MmprojError(f"{path.name}: the vision tower's tensors {', '.join(names[:5])}"
                       f"{' ...' if len(names) > 5 else ''} are missing.",
                       "The file is incomplete or for another model; download the repository's mmproj file again "
                       "or convert it again with llama.cpp's convert_hf_to_gguf.py --mmproj.")


def _arrays(reader, path: Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, in numpy's (row-major, reversed GGML) shape."""
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            out[t.name] = np.asarray(dequantize(t.data, GGMLQuantizationType(t.tensor_type)),
                                     dtype=np.float32).reshape(shape)
        except Exception as e:  # the gguf package raises several kinds for a damaged or unknown type
            raise MmprojError(f"{path.name}: tensor {t.name} ({t.tensor_type.name}) cannot be decoded: {e}.",
                              "The file is damaged; download it again.") from None
    return out


def _tower_tensors(arrays: dict[str, np.ndarray], cfg: VisionConfig, path: Path) -> dict[str, torch.Tensor]:
    """The tower's tensors under its HF names: the patch slices stacked back into the Conv3d [C, 3, 2, P, P]."""
    shapes = vision_shapes(cfg)
    wanted = {n for n in shapes if n != "patch_embed.proj.weight"}
    named = {hf_vision_name(n): a for n, a in arrays.items() if hf_vision_name(n) in wanted}
    ours = {v: k for k, v in _GLOBAL.items()} | {f"blocks.{i}.{hf}.{s}": f"v.blk.{i}.{g}.{s}" for i in range(cfg.depth)
                                                 for g, hf in _BLOCK.items() for s in ("weight", "bias")}
    missing = [ours[n] for n in sorted(wanted - set(named))] + [n for n in PATCH_SLICES if n not in arrays]
    if missing:
        raise _missing(path, missing)
    unknown = sorted(n for n in arrays if n not in PATCH_SLICES and hf_vision_name(n) not in wanted)
    if unknown:  # more than this tower has: another kind of tower, which would run wrongly without them
        raise MmprojError(f"{path.name}: tensors {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} are not "
                          f"part of a Qwen3.5 vision tower of {cfg.depth} blocks.",
                          "Use the mmproj file made for this Qwen3.5 / Qwen3.6 model.")
    named["patch_embed.proj.weight"] = np.stack([arrays[n] for n in PATCH_SLICES], axis=2)
    wrong = [f"{ours.get(n, 'v.patch_embd.weight')} {a.shape} (expected {shapes[n]})" for n, a in named.items()
             if tuple(a.shape) != shapes[n]]
    if wrong:
        raise MmprojError(f"{path.name}: the vision tower's tensors do not match its clip.vision keys: "
                          f"{'; '.join(wrong[:4])}.", "The file is damaged or was converted wrongly; download the "
                                                      "repository's mmproj file again.")
    return {n: torch.from_numpy(np.array(a, dtype=np.float32, order="C")) for n, a in named.items()}  # own copies


def read_mmproj(path: Path, text_hidden: int) -> tuple[VisionConfig, dict[str, torch.Tensor], ImageProcessorConfig]:
    """(tower config, tower tensors under HF names, image processor) of an mmproj file for a text model of hidden size
    `text_hidden`; MmprojError (NInferError) for a file of another projector, another model's size, missing tensors."""
    reader = open_gguf(path)
    _check_kind(reader, path)
    arrays = _arrays(reader, path)
    cfg = read_vision_config(reader, path, arrays)
    if cfg.out_hidden_size != text_hidden:
        raise MmprojError(f"{path.name} projects images to {cfg.out_hidden_size} values per token "
                          f"(clip.vision.projection_dim), but the text model's hidden size is {text_hidden}: it is "
                          f"another model's projector.",
                          "Use the mmproj file from the model's own repository (--mmproj FILE).")
    return cfg, _tower_tensors(arrays, cfg, path), read_processor(reader, cfg)


def read_mmproj_shape(path: Path) -> tuple[VisionConfig, ImageProcessorConfig]:
    """(tower config, image processor) of an mmproj file from its keys and tensor table alone (nothing dequantized):
    what the memory ledger counts; MmprojError (NInferError) where it cannot be this engine's tower."""
    from types import SimpleNamespace

    reader = open_gguf(path)
    _check_kind(reader, path)
    shapes = {t.name: SimpleNamespace(shape=tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    cfg = read_vision_config(reader, path, shapes)
    return cfg, read_processor(reader, cfg)


def load_mmproj_vision(model: Path, setting: str, text_hidden: int, tokenizer, dtype: torch.dtype,
                       device: torch.device):
    """The VisionModel of a GGUF model from its mmproj file (`setting`, or the one beside the model), None where it
    has none. The image token is the text GGUF's <|image_pad|>."""
    from engine.model.vision_input import VisionModel

    path = find_mmproj(model, setting)
    if path is None:
        return None
    try:
        cfg, tensors, processor = read_mmproj(path, text_hidden)
    except ForeignProjectorError as e:
        if setting:
            raise
        log.warning("%s: the vision projector beside it is not loaded, requests with images are refused: %s",
                    model.name, e)
        return None
    token = tokenizer.token_to_id(IMAGE_TOKEN)
    if token is None:
        raise MmprojError(f"{model.name}'s tokenizer has no {IMAGE_TOKEN} token, so images cannot be placed in its "
                          f"prompts (the vision projector is {path.name}).",
                          "Use the GGUF of a Qwen3.5 / Qwen3.6 vision-language model with its mmproj file, or "
                          "serve this one without --mmproj.")
    try:
        tower = VisionTower(cfg, tensors, dtype, device, where=path.name)
    except ModelLoadError as e:
        raise MmprojError(e.problem, "Download the repository's mmproj file again.") from None
    log.info("vision projector %s: %d blocks, hidden %d", path.name, cfg.depth, cfg.hidden_size)
    return VisionModel(tower, processor, token)
