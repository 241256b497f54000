"""A tiny seeded random Qwen3.5 VL checkpoint (transformers' Qwen3_5ForConditionalGeneration: the oracle) saved with
its image processor, and synthetic images for the vision tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.engine.qwen35_models import perturb, save_for_engine, tiny_config

# token ids inside the tiny vocabulary (256)
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 250, 251, 252, 253
MERGE = 2
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 48  # 4 to 48 image tokens: small, quick images


def tiny_vl_config():
    """Text: 4 layers (3 GDN + 1 attention), hidden 64, head_dim 64, M-RoPE [3, 3, 2] interleaved over 16 rotary
    dims. Vision: depth 2, hidden 32, 2 heads, MLP 64, patch 16, merge 2, out 64, an 8 x 8 position table."""
    from transformers import Qwen3_5Config

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True}
    text = tiny_config(num_hidden_layers=4, head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
                       rope_parameters=rope)
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=MERGE, out_hidden_size=64, num_position_embeddings=64)
    return Qwen3_5Config(text_config=text.to_dict(), vision_config=vision, image_token_id=IMAGE_TOKEN,
                         video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                         vision_end_token_id=VISION_END, tie_word_embeddings=False)


def image_processor(**overrides):
    """The checkpoint's processor, as Qwen3.5's published one (patch 16, merge 2, mean = std = 0.5) with smaller
    pixel bounds; transformers' Pillow backend (no torchvision here)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fields = dict(patch_size=16, temporal_patch_size=2, merge_size=MERGE, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                  size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    return Qwen2VLImageProcessorPil(**{**fields, **overrides})


@torch.no_grad()
def perturb_vision(model, scale: float = 0.3) -> None:
    """The tower's weights drawn at 1 / sqrt(fan-in) (transformers' 0.02 init leaves the output to the merger's
    biases, where a dropped position table moves it by 0.3 %), its position table at 1, and every LayerNorm
    weight and bias and every linear bias moved off transformers' init (ones and zeros hide a missing bias or norm)."""
    for name, p in model.named_parameters():
        if not name.startswith("model.visual."):
            continue
        if name.endswith("pos_embed.weight"):
            p.normal_(0.0, 1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, p[0].numel() ** -0.5)
        if name.endswith("bias") or "norm" in name:
            p.add_(scale * torch.randn_like(p))


def tiny_vl_checkpoint(folder: Path, seed: int = 0):
    """(transformers model, folder): the seeded, perturbed tiny VL model saved with its image processor and a
    word-level tokenizer, where load_model / build_engine read it (generation with no end-of-sequence token)."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    hf = Qwen3_5ForConditionalGeneration(tiny_vl_config()).eval()
    perturb(hf)
    perturb_vision(hf)
    save_for_engine(hf, folder)
    image_processor().save_pretrained(folder)
    return hf, folder


def synthetic_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A gradient with noise over it (a smooth part and a sharp part for the resampling), in `mode`."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([255 * xs / max(width - 1, 1), 255 * ys / max(height - 1, 1),
                     127 + 0 * xs], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        image.putalpha(alpha)
        return image
    return image.convert(mode)


def vl_prompt(image_tokens: list[int], text: list[list[int]]) -> list[int]:
    """text[0], then per image: <|vision_start|> pads <|vision_end|> text[i + 1]."""
    ids = list(text[0])
    for n, after in zip(image_tokens, text[1:]):
        ids += [VISION_START] + [IMAGE_TOKEN] * n + [VISION_END] + list(after)
    return ids
