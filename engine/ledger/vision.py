"""A vision-language model's image side in the ledger: the tower's weights, its activations for the largest image,
and the encoder cache (engine/model/encoder_cache.py).

- weights: every tensor of the tower (engine.model.vision.vision_shapes) in the activations' float format, except
  the position table and the LayerNorms, which the tower keeps in fp32 (VisionTower);
- activations, for the largest image (max_pixels = min(the processor's max_pixels, --max-image-pixels): one frame of
  max_pixels / patch^2 patches, the tower's whole input at once): per patch, its pixel values on the tower's device,
  and what one block holds live: the input,
  its fp32 LayerNorm, qkv (3 hidden), q and k rotated, the attention output and its projection (about 8 hidden in the
  activations' format, 2 in fp32), the MLP's fc1 and its GELU (2 intermediate), the fp32 rotary tables (2 head_dim),
  plus the merger's rows. Attention runs through the fused kernels per frame (no patches^2 scores). An estimate;
- the encoder cache: ENCODER_CACHE_IMAGES images of that size, their output rows (out_hidden each merged block) in
  host memory.

Image tokens themselves are prompt tokens: their KV is counted with the text's (the KV line), one token per merged
block of patches, at most max_pixels / (patch x merge)^2 an image."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ENCODER_CACHE_IMAGES = 4  # the encoder cache keeps this many of the largest images' rows
FP32 = 4


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden: int
    heads: int
    intermediate: int
    patch: int
    merge: int
    out_hidden: int
    position_embeddings: int
    in_channels: int = 3
    temporal_patch: int = 2
    max_pixels: int = 0  # the processor's own bound (0: none known; --max-image-pixels alone)

    @classmethod
    def from_config(cls, cfg, max_pixels: int = 0) -> "VisionShape":
        """From an engine.model.vision.VisionConfig (and the processor's max_pixels)."""
        return cls(cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.patch_size,
                   cfg.spatial_merge_size, cfg.out_hidden_size, cfg.num_position_embeddings, cfg.in_channels,
                   cfg.temporal_patch_size, max_pixels)

    @classmethod
    def from_folder(cls, folder: Path) -> "VisionShape | None":
        """An HF folder's tower (config.json's vision_config, preprocessor_config.json's max_pixels), or None."""
        from engine.errors import NInferError
        from engine.model.image_processing import ImageProcessorConfig
        from engine.model.vision import read_vision_config

        try:
            cfg = read_vision_config(folder)
            if cfg is None:
                return None
            max_pixels = ImageProcessorConfig.from_folder(folder).max_pixels
        except NInferError:  # a tower the engine does not load (no image processor, another kind): text only
            return None
        return cls.from_config(cfg, max_pixels)

    @classmethod
    def from_gguf(cls, model: Path) -> "VisionShape | None":
        """A GGUF model's tower from the one mmproj*.gguf beside it (its keys and tensor table), or None: no such
        file, or one the engine would not load (it then serves the model as text, and so is it counted)."""
        from engine.errors import NInferError
        from engine.model.gguf_mmproj import find_mmproj, read_mmproj_shape

        try:
            path = find_mmproj(model, "")
            if path is None:
                return None
            cfg, processor = read_mmproj_shape(path)
        except NInferError:
            return None
        return cls.from_config(cfg, processor.max_pixels)

    def pixels(self, max_image_pixels: int) -> int:
        """The largest image the engine reads: the processor's bound or the setting, whichever is lower."""
        return min(self.max_pixels, max_image_pixels) if self.max_pixels else max_image_pixels

    def patches(self, max_image_pixels: int) -> int:
        return max(self.pixels(max_image_pixels) // self.patch ** 2, self.merge ** 2)

    def tokens(self, max_image_pixels: int) -> int:
        """Image tokens (KV rows) of the largest image."""
        return self.patches(max_image_pixels) // self.merge ** 2

    def dense_params(self) -> int:
        """Parameters the tower keeps in the activations' format (the rest, the position table and the norms,
        are fp32)."""
        c, m, f = self.hidden, self.hidden * self.merge ** 2, self.intermediate
        patch = c * self.in_channels * self.temporal_patch * self.patch ** 2 + c
        block = 3 * c * c + 3 * c + c * c + c + f * c + f + c * f + c
        return patch + self.depth * block + m * m + m + self.out_hidden * m + self.out_hidden

    def fp32_params(self) -> int:
        return self.position_embeddings * self.hidden + 2 * self.hidden * (2 * self.depth + 1)

    def weight_bytes(self, act_bytes: int) -> int:
        return self.dense_params() * act_bytes + self.fp32_params() * FP32

    def activation_bytes(self, max_image_pixels: int, act_bytes: int) -> int:
        n, c, f = self.patches(max_image_pixels), self.hidden, self.intermediate
        patch_values = self.in_channels * self.temporal_patch * self.patch ** 2  # the input, on the tower's device
        per_patch = (patch_values + 8 * c + 2 * f) * act_bytes + (2 * c + 2 * (c // self.heads)) * FP32
        merged = self.tokens(max_image_pixels) * (2 * c * self.merge ** 2 + self.out_hidden) * act_bytes
        return n * per_patch + merged

    def encoder_cache_bytes(self, max_image_pixels: int, act_bytes: int) -> int:
        return ENCODER_CACHE_IMAGES * self.tokens(max_image_pixels) * self.out_hidden * act_bytes


def vision_lines(add, v: VisionShape, max_image_pixels: int, act_bytes: int, include_weights: bool,
                 notes: list[str]) -> None:
    """The ledger lines of a vision-language model's tower (`add(key, name, bytes, ...)` of build_ledger): its
    weights (unless already loaded), its activations for the largest image on the KV device, the encoder cache's
    bound in host memory; and the note that image tokens take KV like text."""
    pixels, tokens = v.pixels(max_image_pixels), v.tokens(max_image_pixels)
    add("vision", f"vision tower ({v.depth} blocks, {v.hidden} wide, dense)",
        v.weight_bytes(act_bytes) if include_weights else 0, note="" if include_weights else "already loaded")
    add("vision_activations", f"vision tower activations (the largest image: {pixels:,} pixels, "
                              f"{v.patches(max_image_pixels):,} patches)",
        v.activation_bytes(max_image_pixels, act_bytes), estimate=True)
    add("encoder_cache", f"vision encoder cache ({ENCODER_CACHE_IMAGES} images of {tokens:,} tokens, host memory)",
        v.encoder_cache_bytes(max_image_pixels, act_bytes), device="host")
    notes.append(f"Image tokens are prompt tokens: their KV is counted like text's (the KV line), up to {tokens:,} "
                 f"tokens an image ({pixels:,} pixels, --max-image-pixels), within the context.")
