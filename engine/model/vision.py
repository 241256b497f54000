"""The vision tower of Qwen3.5 / Qwen3.6 VL checkpoints (`model.visual.*`): image patches -> one embedding of the
text model's width per merged 2 x 2 block of patches, the tokens an image stands for in the prompt.

Patch embedding (a Conv3d whose kernel is its stride, so a linear map of each flattened (C, T, P, P) patch), plus
the learned position table resampled to the image's grid; `depth` pre-norm blocks: LayerNorm -> fused qkv -> 2-D
RoPE -> full attention within each frame (non-causal, no windows) -> proj, LayerNorm -> fc1 -> GELU (tanh) -> fc2;
the merger: LayerNorm per patch, each merge x merge block's patches side by side -> fc1 -> exact GELU -> fc2.
Qwen3.5 has no DeepStack outputs (Qwen3-VL's extra mergers): a config asking for them is refused."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model.config import VISION_PREFIX
from engine.model.linear import LOW_BIT, DenseScratch, Linear
from engine.model.vision_rope import (apply_rotary, frame_lengths, grid_list, patch_coordinates, resampled_positions,
                                      rotary_tables)
from kernels.quant import quantize_int8

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}
LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    """config.json's "vision_config" (defaults: transformers' Qwen3_5VisionConfig, the 27B's tower)."""
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: C x T x P x P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "VisionConfig":
        if raw.get("deepstack_visual_indexes"):
            raise ModelLoadError(f"{where}: the vision tower has DeepStack layers {raw['deepstack_visual_indexes']} "
                                 f"(a Qwen3-VL tower), which this engine does not run.",
                                 "Use a Qwen3.5 / Qwen3.6 checkpoint, or serve the text model only.")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"{where}: vision rope type {rope['rope_type']!r} is not the axial 2-D RoPE of "
                                 f"Qwen3.5's tower.", "Use a Qwen3.5 / Qwen3.6 checkpoint.")
        d = cls()
        try:
            fields = {name: type(getattr(d, name))(raw.get(name, getattr(d, name)))
                      for name in cls.__dataclass_fields__ if name != "rope_theta"}
            cfg = cls(**fields, rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", d.rope_theta))))
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{where}: a vision_config field is malformed ({e}).",
                                 "Download the model folder again.") from None
        if cfg.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"{where}: vision activation {cfg.hidden_act!r} is not supported.",
                                 f"Supported: {', '.join(ACTIVATIONS)}.")
        return cfg


def vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower (names after model.visual.) and its shape."""
    c, m, f = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size ** 2, cfg.intermediate_size
    p, t = cfg.patch_size, cfg.temporal_patch_size
    shapes = {"patch_embed.proj.weight": (c, cfg.in_channels, t, p, p), "patch_embed.proj.bias": (c,),
              "pos_embed.weight": (cfg.num_position_embeddings, c),
              "merger.norm.weight": (c,), "merger.norm.bias": (c,),
              "merger.linear_fc1.weight": (m, m), "merger.linear_fc1.bias": (m,),
              "merger.linear_fc2.weight": (cfg.out_hidden_size, m), "merger.linear_fc2.bias": (cfg.out_hidden_size,)}
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        shapes |= {b + "norm1.weight": (c,), b + "norm1.bias": (c,), b + "norm2.weight": (c,), b + "norm2.bias": (c,),
                   b + "attn.qkv.weight": (3 * c, c), b + "attn.qkv.bias": (3 * c,),
                   b + "attn.proj.weight": (c, c), b + "attn.proj.bias": (c,),
                   b + "mlp.linear_fc1.weight": (f, c), b + "mlp.linear_fc1.bias": (f,),
                   b + "mlp.linear_fc2.weight": (c, f), b + "mlp.linear_fc2.bias": (c,)}
    return shapes


def check_vision_tensors(cfg: VisionConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Every tensor present with its shape; none unknown (a tower of another kind)."""
    shapes = vision_shapes(cfg)
    missing = sorted(set(shapes) - set(tensors))
    unknown = sorted(set(tensors) - set(shapes))
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {shapes[n]})" for n in sorted(set(shapes) & set(tensors))
             if tuple(tensors[n].shape) != shapes[n]]
    if not cfg.num_position_embeddings or int(cfg.num_position_embeddings ** 0.5) ** 2 != cfg.num_position_embeddings:
        wrong.append(f"num_position_embeddings {cfg.num_position_embeddings} (a square grid's count expected)")
    problems = ([f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"] if missing else []) + \
               ([f"unexpected {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"] if unknown else []) + wrong
    if problems:
        raise ModelLoadError(f"{where}: the vision tower's tensors do not match its config: {'; '.join(problems)}.",
                             "Download the model folder again (config.json and every *.safetensors file).")


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """In float32 whatever the tower's dtype (activations reach thousands), back in x's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, LAYER_NORM_EPS).to(x.dtype)


class VisionBlock:
    def __init__(self, cfg: VisionConfig, prefix: str, linear, norm):
        """`linear(name)`: the Linear of name.weight and name.bias; `norm(name)`: (name.weight, name.bias)."""
        self.cfg = cfg
        self.norm1, self.norm2 = norm(prefix + "norm1"), norm(prefix + "norm2")
        self.qkv, self.proj = linear(prefix + "attn.qkv"), linear(prefix + "attn.proj")
        self.fc1, self.fc2 = linear(prefix + "mlp.linear_fc1"), linear(prefix + "mlp.linear_fc2")
        self.approximate = ACTIVATIONS[cfg.hidden_act]

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        heads, hd = self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).view(-1, 3, heads, hd).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = []
        # [1, heads, frame, hd] per frame: 4-D inputs take the fused (flash) kernels, which never hold frame^2 scores
        for qs, ks, vs in zip(*(t.transpose(0, 1)[None].split(lengths, dim=2) for t in (q, k, v))):
            out.append(F.scaled_dot_product_attention(qs, ks, vs, scale=hd ** -0.5)[0])
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(-1, heads * hd))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(_layer_norm(x, *self.norm1), cos, sin, lengths)
        h = F.gelu(self.fc1(_layer_norm(x, *self.norm2)), approximate=self.approximate)
        return x + self.fc2(h)


class VisionTower:
    """`tower(pixel_values, grid_thw)` -> [tokens, out_hidden_size] image embeddings, the images' in order.

    `weight_format` "int8": the blocks' and the merger's linear weights int8 per output channel (half bf16's bytes,
    multiplied dense after dequantizing), the patch embedding, the position table and the norms dense; anything
    else: every weight dense in `dtype`. `tensors`: the tower's, named with or without "model.visual."."""

    def __init__(self, cfg: VisionConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", weight_format: str = "", where: str = "vision tower"):
        tensors = {n.removeprefix(VISION_PREFIX): t for n, t in tensors.items()}
        check_vision_tensors(cfg, tensors, where)
        if weight_format in LOW_BIT and weight_format != "int8":
            raise ModelLoadError(f"The vision tower runs dense or int8, not {weight_format}.",
                                 "Pass weight_format 'int8' or a dense format for it.")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.int8 = weight_format == "int8"
        dense = lambda n: tensors[n].to(device=self.device, dtype=dtype)  # noqa: E731
        self.patch_embed = Linear(dense("patch_embed.proj.weight").reshape(cfg.hidden_size, -1),
                                  dense("patch_embed.proj.bias"))
        self.pos_table = tensors["pos_embed.weight"].to(device=self.device, dtype=torch.float32)
        norm = lambda p: tuple(tensors[p + s].to(device=self.device, dtype=torch.float32)  # noqa: E731
                               for s in (".weight", ".bias"))
        linear = lambda p: Linear(self._linear_weight(tensors[p + ".weight"]), dense(p + ".bias"))  # noqa: E731
        self.blocks = [VisionBlock(cfg, f"blocks.{i}.", linear, norm) for i in range(cfg.depth)]
        self.merger_norm = norm("merger.norm")
        self.merger_fc1, self.merger_fc2 = linear("merger.linear_fc1"), linear("merger.linear_fc2")
        if self.int8:
            self._share_dense_scratch()

    def _share_dense_scratch(self) -> None:
        """int8 weights dequantized into one shared buffer and multiplied dense: the tower always computes many rows
        (the int8 kernels are for decode rows: 12x slower here, 2,208 patches through a 0.8B-size tower on 2 cores)."""
        linears = [v for b in self.blocks for v in (b.qkv, b.proj, b.fc1, b.fc2)] + [self.merger_fc1, self.merger_fc2]
        scratch = DenseScratch(1, max(v.weight.out_features * v.weight.in_features for v in linears))
        for v in linears:
            v.scratch = scratch

    def _linear_weight(self, w: torch.Tensor):
        if self.int8:
            return quantize_int8(w.float()).to(self.device)
        return w.to(device=self.device, dtype=self.dtype)

    def check_input(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
        cfg = self.cfg
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must be [images, 3] (t, h, w), not {list(grid_thw.shape)}.")
        grids = grid_list(grid_thw)
        m = cfg.spatial_merge_size
        if any(t < 1 or h < m or w < m or h % m or w % m for t, h, w in grids):
            raise ValueError(f"Every grid must have t >= 1 and h, w multiples of {m}: {grids}.")
        patches = sum(t * h * w for t, h, w in grids)
        if tuple(pixel_values.shape) != (patches, cfg.patch_dim):
            raise ValueError(f"pixel_values is {list(pixel_values.shape)}, the grids {grids} need [{patches}, "
                             f"{cfg.patch_dim}]: preprocess the images with this model's image processor.")
        return grids

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        grids = self.check_input(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values.to(device=self.device, dtype=self.dtype))
        x = x + resampled_positions(self.pos_table, grids, cfg.spatial_merge_size).to(x.dtype)
        cos, sin = rotary_tables(patch_coordinates(grids, cfg.spatial_merge_size, self.device), cfg.head_dim,
                                 cfg.rope_theta)
        lengths = frame_lengths(grids)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merge(x)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """Patch features [patches, C] -> [patches / merge^2, out_hidden_size]: one row per merged block."""
        x = _layer_norm(x, *self.merger_norm).reshape(-1, self.cfg.hidden_size * self.cfg.spatial_merge_size ** 2)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))


def split_per_image(embeddings: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> list[torch.Tensor]:
    """The tower's output cut into one [tokens, hidden] tensor per image."""
    return list(embeddings.split([t * h * w // merge ** 2 for t, h, w in grid_list(grid_thw)]))


def read_vision_config(folder: Path) -> VisionConfig | None:
    """The folder's vision tower config, or None for a text-only checkpoint."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} cannot be read: {e}.", "Download the model folder again.") from None
    vision = raw.get("vision_config")
    return None if vision is None else VisionConfig.from_dict(vision, str(path))


def read_vision_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The `model.visual.*` tensors of a folder's safetensors files, under their names after that prefix."""
    from safetensors import safe_open

    tensors = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    if key.startswith(VISION_PREFIX):
                        tensors[key.removeprefix(VISION_PREFIX)] = handle.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ModelLoadError(f"{f}: the vision tower's tensors cannot be read ({e}).",
                                 "The file is truncated or damaged; download it again.") from None
    return tensors


def load_vision(folder: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                weight_format: str = "") -> VisionTower | None:
    """The vision tower of an HF folder (Qwen3_5ForConditionalGeneration), or None where it has none."""
    cfg = read_vision_config(folder)
    if cfg is None:
        return None
    return VisionTower(cfg, read_vision_tensors(folder), dtype, device, weight_format, where=Path(folder).name)
