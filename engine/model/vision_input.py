"""Images in a request, as the engine carries them (issue #36): the model's vision part (`VisionModel`, a
LoadedModel's `vision`), and one prompt's images (`PromptImages`, on its Sequence).

The seam: the caller's prompt already holds each image's run of <|image_pad|> tokens (expand_image_placeholders),
and `images` are the images themselves (encoded bytes or Pillow images, in prompt order). `VisionModel.prepare`
runs on the caller's thread: preprocessing (image_processing.py) and the M-RoPE positions (vision_positions.py),
which also checks that the placeholders match the images, so a bad request is refused at submit. The tower runs
on the engine thread when the sequence is first scheduled (`VisionModel.embed`); its rows stay on the sequence
(a preempted sequence recomputes its KV from them, not the tower), and each image's rows stay in the encoder cache
(encoder_cache.py, by content hash), so an image sent again skips the tower. Each prompt chunk takes its slice
(`PromptImages.chunk`): the image rows that fall inside it and its [3, n] positions, so a chunk may cut an image.
The prefix cache keys a prompt with images by `PromptImages.key_ids` (image_keys.py): the same image at the same
place reuses its pages, another image never does.

After the prompt every token's three position rows are equal, index + `delta`: decode is 1-D RoPE at a shifted
position (Work.rope_delta)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image

from engine.errors import ModelLoadError, NInferError
from engine.model.encoder_cache import EncoderCache
from engine.model.image_keys import image_hash, key_ids
from engine.model.image_processing import (ImageInputError, ImageProcessorConfig, image_token_count, open_image,
                                           preprocess)
from engine.model.vision import VisionTower, read_vision_config, read_vision_tensors
from engine.model.vision_positions import mrope_positions


class ImagesNotSupportedError(NInferError):
    """A request with images to a model that has no vision tower loaded."""

    def __init__(self, model_name: str, why: str):
        super().__init__(f"This request has images, but {model_name} {why}, so it cannot read them.",
                         "Send the request without images, or load a Qwen3.5 / Qwen3.6 vision-language checkpoint "
                         "(an HF folder with a vision_config and its model.visual.* weights).")


@dataclass
class PromptImages:
    """One prompt's images: the tower's input, the prompt's M-RoPE positions and, once embedded, the rows."""
    pixel_values: torch.Tensor  # float32 [patches, C*T*P*P]
    grid_thw: torch.Tensor  # int64 [images, 3]
    positions: torch.Tensor  # int64 [3, prompt length]
    delta: int  # a token at index i >= prompt length has position i + delta (all three rows)
    image_at: torch.Tensor  # int64 [image tokens]: the prompt index of each <|image_pad|>, in order
    hashes: list[bytes] = field(default_factory=list)  # per image: its content hash (image_keys.image_hash)
    key_ids: list[int] = field(default_factory=list)  # per image token: its id in the prefix cache's keys
    rows: torch.Tensor | None = None  # [image tokens, hidden] once VisionModel.embed ran

    @property
    def count(self) -> int:
        return int(self.grid_thw.shape[0])

    def chunk_positions(self, start: int, n: int) -> torch.Tensor:
        """[3, n] positions of tokens [start, start + n): the prompt's, then index + delta past the prompt (a
        preempted sequence recomputes its answer's tokens too)."""
        length = self.positions.shape[1]
        inside = self.positions[:, start:min(start + n, length)]
        after = torch.arange(max(start, length), max(start + n, length)) + self.delta
        return torch.cat((inside, after.expand(3, -1)), dim=1)

    def _span(self, start: int, n: int) -> tuple[int, int]:
        """[lo, hi): the image tokens (in order) among tokens [start, start + n)."""
        return int(torch.searchsorted(self.image_at, start)), int(torch.searchsorted(self.image_at, start + n))

    def needs_rows(self, start: int, n: int) -> bool:
        """Whether tokens [start, start + n) hold image tokens whose rows are not computed yet (a prefix reused
        past every image needs no tower at all)."""
        lo, hi = self._span(start, n)
        return self.rows is None and hi > lo

    def chunk_rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(indices within the chunk, rows) of the image tokens among tokens [start, start + n), or None."""
        lo, hi = self._span(start, n)
        if lo == hi:
            return None
        if self.rows is None:
            raise RuntimeError("PromptImages.chunk_rows before VisionModel.embed computed the image rows")
        return self.image_at[lo:hi] - start, self.rows[lo:hi]


class VisionModel:
    """A vision-language checkpoint's image side: the tower, its image processor and the prompt's image token."""

    def __init__(self, tower: VisionTower, processor: ImageProcessorConfig, image_token_id: int,
                 encoder_cache_bytes: int = 0):
        """`encoder_cache_bytes`: the encoder cache's bound, which load_model sets from the ledger
        (engine/ledger/vision.py); 0 keeps no rows."""
        self.tower, self.processor, self.image_token_id = tower, processor, image_token_id
        self.merge = tower.cfg.spatial_merge_size
        self.tower_calls = 0  # images the tower ran for
        self.encoder_cache = EncoderCache(encoder_cache_bytes)

    def limit_pixels(self, max_image_pixels: int) -> None:
        """Images larger than `max_image_pixels` (--max-image-pixels) are scaled down to fit, as by the processor's
        own max_pixels (the lower of the two holds)."""
        if max_image_pixels < 1:
            raise NInferError(f"max_image_pixels is {max_image_pixels}: no image would fit.",
                              "Set --max-image-pixels to a positive pixel count (default 4194304).")
        if max_image_pixels < self.processor.max_pixels:
            self.processor = replace(self.processor, max_pixels=max_image_pixels,
                                     min_pixels=min(self.processor.min_pixels, max_image_pixels))

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype, device: torch.device) -> "VisionModel | None":
        """The folder's vision part, or None where it has no vision_config or no model.visual.* weights (a
        text-only checkpoint, or one saved without its tower)."""
        folder = Path(folder)
        cfg = read_vision_config(folder)
        if cfg is None:
            return None
        tensors = read_vision_tensors(folder)
        if not tensors:
            return None
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        token = raw.get("image_token_id", raw.get("image_token_index"))
        if not isinstance(token, int):
            raise ModelLoadError(f"{folder / 'config.json'} has a vision tower but no integer image_token_id.",
                                 "Download the model folder's config.json again.")
        tower = VisionTower(cfg, tensors, dtype, device, where=folder.name)
        return cls(tower, ImageProcessorConfig.from_folder(folder), token)

    def prepare(self, prompt: list[int], images: list) -> PromptImages:
        """Preprocesses `images` (bytes or Pillow images, in prompt order) and places them in `prompt`; raises
        ImageInputError / ImagePlacementError (NInferError) when an image cannot be read or the placeholders
        disagree with the images."""
        if not images:
            raise ImageInputError("The request's image list is empty.", "Leave `images` out for a text-only request.")
        decoded = [self._decode(i, image) for i, image in enumerate(images)]
        pixels, grid = preprocess(decoded, self.processor)
        positions, delta = mrope_positions(prompt, grid, self.image_token_id, self.merge)
        image_at = torch.nonzero(torch.tensor(prompt) == self.image_token_id).flatten()
        grids = [tuple(int(v) for v in g) for g in grid]
        hashes = [image_hash(image, g) for image, g in zip(images, grids)]
        ids = [i for digest, g in zip(hashes, grids) for i in key_ids(digest, image_token_count(g, self.merge))]
        return PromptImages(pixels, grid, positions, delta, image_at, hashes, ids)

    @staticmethod
    def _decode(i: int, image) -> Image.Image:
        if isinstance(image, Image.Image):
            return image
        if isinstance(image, (bytes, bytearray, memoryview)):
            return open_image(bytes(image))
        raise ImageInputError(f"Image {i + 1} is a {type(image).__name__}, not encoded image bytes or a Pillow "
                              f"image.", "Pass each image as the bytes of its file (PNG, JPEG, ...).")

    @torch.inference_mode()
    def embed(self, images: PromptImages, dtype: torch.dtype, device: torch.device) -> None:
        """The prompt's image rows (engine thread), in the text model's dtype and device: each image's from the
        encoder cache, or from the tower, which runs for one image at a time (an image's rows do not depend on the
        images beside it) and whose rows the cache then keeps."""
        if images.rows is not None:
            return
        per_image, start = [], 0
        for digest, grid in zip(images.hashes, images.grid_thw):
            patches = int(grid.prod())
            rows = self.encoder_cache.get(digest)
            if rows is None:
                pixels = images.pixel_values[start:start + patches].to(device=self.tower.device, dtype=self.tower.dtype)
                rows = self.tower(pixels, grid[None])
                self.tower_calls += 1
                self.encoder_cache.put(digest, rows)
            per_image.append(rows.to(device=device, dtype=dtype))
            start += patches
        images.rows = torch.cat(per_image)
