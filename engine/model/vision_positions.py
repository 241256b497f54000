"""Multimodal RoPE (M-RoPE) positions of a prompt with images, as Qwen3.5's language model reads them: three rows
(time, height, width) per token.

A text token's three positions are equal: one more than the token before. An image's <|image_pad|> tokens, one per
merged block, the image starting at position s (the position after its <|vision_start|>), get (s + frame, s + row,
s + col) over the merged grid (h / merge x w / merge). The token after the image continues at s + max(rows, cols),
not s + rows x cols, so a prompt's positions end below its length: `delta` = last position + 1 - length, and a token
decoded at index i (counted in tokens) has position i + delta in all three rows."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.errors import NInferError


class ImagePlacementError(NInferError):
    """A prompt's image placeholders disagree with its images."""


def _image_runs(is_image: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of every run of consecutive image tokens."""
    flags = torch.cat((torch.zeros(1, dtype=torch.int8), is_image.to(torch.int8), torch.zeros(1, dtype=torch.int8)))
    edges = torch.nonzero(flags[1:] != flags[:-1]).flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def image_positions(start: int, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[3, tokens] positions of one image's tokens, the image starting at `start`."""
    t, h, w = grid
    frames, rows, cols = torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge),
                                        indexing="ij")
    return torch.stack((frames, rows, cols)).reshape(3, -1) + start


def _place_images(run_length: int, grids: list, used: int, merge: int) -> list[tuple[int, int, int]]:
    """The images whose tokens fill one run of `run_length` placeholders, taken in order from grids[used:]."""
    placed, filled = [], 0
    while filled < run_length:
        if used + len(placed) == len(grids):
            raise ImagePlacementError(f"The prompt has more image placeholder tokens than its {len(grids)} image(s) "
                                      f"fill.", "Put exactly one image's token count of placeholders per image.")
        t, h, w = grids[used + len(placed)]
        placed.append((t, h, w))
        filled += t * (h // merge) * (w // merge)
    if filled != run_length:
        raise ImagePlacementError(f"A run of {run_length} image placeholder tokens does not match its images' token "
                                  f"counts ({filled} for {len(placed)} image(s)).",
                                  "Repeat <|image_pad|> exactly grid t*h*w / merge^2 times for each image.")
    return placed


def expand_image_placeholders(token_ids: Sequence[int], image_grids: torch.Tensor | Sequence, image_token_id: int,
                              merge: int) -> list[int]:
    """The prompt with each single <|image_pad|> (as the chat template renders an image) repeated as many times as
    its image has tokens (grid t*h*w / merge^2), as transformers' Qwen3-VL processor does to the text."""
    grids = [tuple(int(v) for v in g) for g in (image_grids.tolist() if torch.is_tensor(image_grids) else image_grids)]
    ids = list(token_ids)
    found = ids.count(image_token_id)
    if found != len(grids):
        raise ImagePlacementError(f"The prompt has {found} image placeholder(s) for {len(grids)} image(s).",
                                  "Render each image as one <|image_pad|> between <|vision_start|> and "
                                  "<|vision_end|>, in the order of the images.")
    counts = iter(t * (h // merge) * (w // merge) for t, h, w in grids)
    out: list[int] = []
    for token in ids:
        out.extend([token] * next(counts) if token == image_token_id else [token])
    return out


def mrope_positions(token_ids: Sequence[int] | torch.Tensor, image_grids: torch.Tensor | Sequence,
                    image_token_id: int, merge: int) -> tuple[torch.Tensor, int]:
    """(positions int64 [3, len(token_ids)], delta) for a prompt whose images (grid_thw rows, in prompt order)
    stand as runs of `image_token_id`."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
    grids = [tuple(int(v) for v in g) for g in (image_grids.tolist() if torch.is_tensor(image_grids) else image_grids)]
    pieces, pos, prev, used = [], 0, 0, 0
    for start, end in _image_runs(ids == image_token_id):
        pieces.append(torch.arange(start - prev).expand(3, -1) + pos)
        pos += start - prev
        for grid in _place_images(end - start, grids, used, merge):
            pieces.append(image_positions(pos, grid, merge))
            pos += max(grid[1], grid[2]) // merge
            used += 1
        prev = end
    if used != len(grids):
        raise ImagePlacementError(f"The prompt places {used} of its {len(grids)} images: placeholders are missing.",
                                  "Put one run of <|image_pad|> tokens in the prompt for each image.")
    pieces.append(torch.arange(len(ids) - prev).expand(3, -1) + pos)
    positions = torch.cat(pieces, dim=1)
    last = int(positions.max()) if positions.numel() else -1
    return positions, last + 1 - len(ids)


def decode_positions(first_index: int, count: int, delta: int) -> torch.Tensor:
    """[3, count] positions of tokens at indices first_index.. after a prompt with images (equal rows)."""
    return (torch.arange(first_index, first_index + count) + delta).expand(3, -1)


def mrope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, section: Sequence[int]) -> torch.Tensor:
    """The text model's rotary angles [tokens, len(inv_freq)] from [3, tokens] positions, interleaved as
    Qwen3.5's (mrope_section [t, h, w]): frequency j follows the height row where j % 3 == 1 and j < 3h, the width
    row where j % 3 == 2 and j < 3w, else the time row. cos/sin of cat(angles, angles) rotate the first
    partial_rotary dims of each head, as for 1-D RoPE. Equal rows give 1-D RoPE's angles."""
    if len(section) != 3 or sum(section) != inv_freq.numel():
        raise ValueError(f"mrope_section {list(section)} must have 3 parts adding up to the {inv_freq.numel()} "
                         f"rotary frequencies.")
    freqs = positions.float()[..., None] * inv_freq.float().to(positions.device)  # [3, tokens, F]
    angles = freqs[0].clone()
    for row in (1, 2):
        picked = slice(row, 3 * section[row], 3)
        angles[:, picked] = freqs[row][:, picked]
    return angles
