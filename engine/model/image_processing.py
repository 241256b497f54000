"""Images -> the vision tower's input, as the Qwen2-VL image processor that Qwen3.5 VL checkpoints ship
(transformers' Qwen2VLImageProcessorPil, the reference): RGB (transparency over white), `smart_resize` to sides that
are multiples of patch_size x merge_size with the pixel count inside [min_pixels, max_pixels], Pillow's resampling
(BICUBIC), x rescale_factor, (x - mean) / std, then patches: each merge_size x merge_size block of patches
consecutive, each patch (C, temporal_patch_size, P, P) flattened, the one frame repeated over the temporal patch.

`preprocess(images, config)` gives `pixel_values` [patches, C*T*P*P] float32 and `grid_thw` [images, 3]; an image
costs grid t*h*w / merge_size^2 tokens in the prompt (`image_token_count`)."""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engine.errors import NInferError

MAX_ASPECT_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the class defaults, used where preprocessor_config.json is silent
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageInputError(NInferError):
    """An image that cannot be turned into the vision tower's input."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of a checkpoint's preprocessor_config.json this processor reads (defaults: transformers'
    Qwen2VLImageProcessor class defaults, which the published Qwen3.5 files override: patch 16, mean = std = 0.5)."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        """What each resized side is a multiple of: one merged block of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict) -> "ImageProcessorConfig":
        """From preprocessor_config.json's fields. The pixel bounds: min_pixels / max_pixels where given, else `size`
        {shortest_edge, longest_edge} (pixel counts, not sides), the precedence of transformers' __init__."""
        d = cls()
        size = raw.get("size") or {}
        mean, std = raw.get("image_mean", d.image_mean), raw.get("image_std", d.image_std)
        try:
            return cls(
                patch_size=int(raw.get("patch_size", d.patch_size)),
                temporal_patch_size=int(raw.get("temporal_patch_size", d.temporal_patch_size)),
                merge_size=int(raw.get("merge_size", d.merge_size)),
                min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
                max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
                image_mean=tuple(float(m) for m in (mean if isinstance(mean, (list, tuple)) else [mean] * 3)),
                image_std=tuple(float(s) for s in (std if isinstance(std, (list, tuple)) else [std] * 3)),
                rescale_factor=float(raw.get("rescale_factor", d.rescale_factor)),
                resample=int(raw.get("resample", d.resample)),
                do_resize=bool(raw.get("do_resize", True)), do_rescale=bool(raw.get("do_rescale", True)),
                do_normalize=bool(raw.get("do_normalize", True)),
                do_convert_rgb=bool(raw.get("do_convert_rgb", True)))
        except (TypeError, ValueError, AttributeError) as e:
            raise ImageInputError(f"The image processor's settings are malformed ({e}).",
                                  "Download the model folder's preprocessor_config.json again.") from None

    @classmethod
    def from_folder(cls, folder: Path) -> "ImageProcessorConfig":
        path = Path(folder) / "preprocessor_config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ImageInputError(f"{folder} has no preprocessor_config.json: the image settings of this model are "
                                  f"unknown.", "Download the model folder with its preprocessor_config.json.") from None
        except (OSError, ValueError) as e:
            raise ImageInputError(f"{path} cannot be read: {e}.", "Download the model folder again.") from None
        return cls.from_dict(raw.get("image_processor", raw))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` (Python's round: half to even), scaled down (floor) to at
    most max_pixels or up (ceil) to at least min_pixels, keeping the aspect ratio as closely as those allow."""
    if min(height, width) < 1:
        raise ImageInputError(f"The image is {width}x{height} pixels: it has no pixels.", "Send a non-empty image.")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInputError(f"The image is {width}x{height} pixels: its aspect ratio is over {MAX_ASPECT_RATIO}:1.",
                              f"Crop or pad it to at most {MAX_ASPECT_RATIO}:1.")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def open_image(data: bytes) -> Image.Image:
    """Decoded image bytes (PNG, JPEG, WebP, GIF: Pillow's formats); the pixels are read here, not later."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"The image is too large to decode ({e}).", "Send a smaller image.") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageInputError(f"The image cannot be decoded ({e}).",
                              "Send a PNG, JPEG, WebP or GIF image.") from None
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited over white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _pixels(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """One image resized, rescaled and normalised: float32 [C, H, W]."""
    if not isinstance(image, Image.Image):
        raise ImageInputError(f"An image must be a PIL image, not {type(image).__name__}.",
                              "Decode the bytes with engine.model.image_processing.open_image first.")
    if cfg.do_convert_rgb:
        image = to_rgb(image)
    elif image.mode != "RGB":
        raise ImageInputError(f"The image is in mode {image.mode}, and this model's processor does not convert "
                              f"to RGB.", "Convert the image to RGB before sending it.")
    if cfg.do_resize:
        height, width = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        image = image.resize((width, height), resample=Image.Resampling(cfg.resample))
    pixels = np.moveaxis(np.asarray(image), -1, 0)
    if cfg.do_rescale:
        pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    pixels = np.asarray(pixels, dtype=np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(cfg.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return pixels


def patchify(pixels: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, int, int]:
    """[C, H, W] -> ([patches, C*T*P*P], grid_h, grid_w): merge blocks consecutive, block-major, rows first."""
    channels, height, width = pixels.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if height % cfg.factor or width % cfg.factor:
        raise ImageInputError(f"A {width}x{height} image cannot be cut into {cfg.factor}-pixel blocks.",
                              "Keep do_resize on in preprocessor_config.json, or resize the image first.")
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    blocks = np.transpose(blocks, (1, 4, 2, 5, 0, 3, 6))  # (block row, block col, row in block, col in block, C, P, P)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return frames.reshape(grid_h * grid_w, channels * t * p * p), grid_h, grid_w


def preprocess(images: list[Image.Image], cfg: ImageProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values float32 [patches, C*T*P*P], grid_thw int64 [images, 3]) for the vision tower, the images'
    patches one after the other."""
    if not images:
        raise ImageInputError("No image was given to preprocess.", "Pass at least one image.")
    patches, grids = [], []
    for image in images:
        flat, grid_h, grid_w = patchify(_pixels(image, cfg), cfg)
        patches.append(flat)
        grids.append((1, grid_h, grid_w))
    return torch.from_numpy(np.concatenate(patches, axis=0)), torch.tensor(grids, dtype=torch.int64)


def image_token_count(grid_thw: tuple[int, int, int] | torch.Tensor, merge_size: int) -> int:
    """The <|image_pad|> tokens one image takes in the prompt: one per merge_size x merge_size block of patches."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)
