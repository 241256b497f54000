"""Where each patch of the vision tower is: its (row, col) in its image, the 2-D rotary tables built from them, the
learned position table resampled to the image's grid, and the frames attention is confined to.

Patch order (the image processor's, engine/model/image_processing.patchify): each merge x merge block of patches is
consecutive, blocks row by row; a video's frames one after the other (an image is one frame)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """grid_thw [images, 3] as Python (t, h, w) triples."""
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def _block_major(values: torch.Tensor, merge: int) -> torch.Tensor:
    """An [h, w, ...] grid in patch order: [h * w, ...], each merge x merge block consecutive."""
    h, w = values.shape[:2]
    blocks = values.reshape(h // merge, merge, w // merge, merge, *values.shape[2:]).transpose(1, 2)
    return blocks.reshape(h * w, *values.shape[2:])


def patch_coordinates(grids: list[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """[patches, 2] (row, col) of every patch in its frame, in patch order."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        out.append(_block_major(torch.stack((rows, cols), dim=-1), merge).repeat(t, 1))
    return torch.cat(out)


def rotary_tables(coords: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The axial 2-D RoPE of Qwen3-VL/3.5's tower, float32 cos and sin [patches, head_dim]: head_dim / 4
    frequencies per axis, angles [row x f | col x f], the whole repeated twice (rotate_half over the full head)."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=coords.device) / half)
    angles = coords.float()[..., None] * inv_freq  # [patches, 2, head_dim / 4]
    angles = angles.flatten(1)  # [row frequencies | col frequencies]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [patches, heads, head_dim] rotated in float32 (a bf16 rotation loses the positions), back in x's dtype."""
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def resampled_positions(table: torch.Tensor, grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """The learned [side * side, C] position table resampled to each frame's h x w grid (bilinear, corners
    aligned: the table's corners land on the grid's corner patches), float32 [patches, C] in patch order."""
    side = math.isqrt(table.shape[0])
    square = table.float().reshape(side, side, -1).permute(2, 0, 1)[None]  # [1, C, side, side]
    out = []
    for t, h, w in grids:
        grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        out.append(_block_major(grid, merge).repeat(t, 1))
    return torch.cat(out)


def frame_lengths(grids: list[tuple[int, int, int]]) -> list[int]:
    """Patches per attention segment: every frame of every image attends to itself only, all of it (no mask)."""
    return [h * w for t, h, w in grids for _ in range(t)]
