"""The Qwen3.5 VL image side against transformers (the oracle): the image processor, the vision tower and merger,
the M-RoPE positions of a prompt with images, and reading the tower from a folder."""
from __future__ import annotations

import json

import pytest
import torch

from engine.errors import ModelLoadError
from engine.model.image_processing import (ImageInputError, ImageProcessorConfig, image_token_count, open_image,
                                           preprocess, smart_resize)
from engine.model.vision import VisionConfig, VisionTower, load_vision, read_vision_tensors, split_per_image
from engine.model.vision_positions import (ImagePlacementError, decode_positions, expand_image_placeholders,
                                           mrope_angles, mrope_positions)
from tests.engine.vision_models import (IMAGE_TOKEN, MAX_PIXELS, MERGE, MIN_PIXELS, image_processor,
                                        synthetic_image, tiny_vl_checkpoint, vl_prompt)

SIZES = [(20, 30), (37, 251), (300, 500), (96, 64), (100, 70), (48, 48)]  # (width, height): below min_pixels,
# 1:7 aspect, above max_pixels, exact multiples, the doc's example, a square


def relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return tiny_vl_checkpoint(tmp_path_factory.mktemp("qwen35-vl") / "tiny-qwen35-vl")


def hf_preprocess(processor, images):
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


# ---------------------------------------------------------------------------------------------------- preprocessing
def test_smart_resize_matches_transformers_including_rounding_ties():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    sides = [1, 15, 16, 17, 31, 48, 80, 112, 250, 333, 1000, 1080, 1920, 3024, 4032]
    for h in sides:
        for w in sides:
            if max(h, w) / min(h, w) > 200:
                continue
            for lo, hi in ((MIN_PIXELS, MAX_PIXELS), (65536, 16777216), (56 * 56, 28 * 28 * 1280)):
                assert smart_resize(h, w, 32, lo, hi) == reference(h, w, 32, lo, hi), (h, w, lo, hi)


@pytest.mark.parametrize("width,height", SIZES)
def test_preprocessing_matches_transformers(vl, width, height):
    _, folder = vl
    cfg = ImageProcessorConfig.from_folder(folder)
    image = synthetic_image(width, height, seed=width * height)
    pixels, grid = preprocess([image], cfg)
    ref_pixels, ref_grid = hf_preprocess(image_processor(), [image])
    assert torch.equal(grid, ref_grid)
    assert pixels.dtype == torch.float32 and pixels.shape == ref_pixels.shape
    assert float((pixels - ref_pixels).abs().max()) <= 1e-6
    t, h, w = grid[0].tolist()
    assert h * w <= MAX_PIXELS // 256 and image_token_count(grid[0], MERGE) == h * w // 4


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_preprocessing_converts_modes_as_transformers(mode):
    """Transparency over white, grey and palette images to RGB; the class-default processor (patch 14, CLIP mean
    and std) read from the same fields transformers reads."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = [synthetic_image(90, 61, seed=1, mode=mode), synthetic_image(40, 200, seed=2, mode=mode)]
    ref = Qwen2VLImageProcessorPil(max_pixels=28 * 28 * 64)
    cfg = ImageProcessorConfig.from_dict(ref.to_dict())
    assert (cfg.patch_size, cfg.max_pixels) == (14, 28 * 28 * 64)
    pixels, grid = preprocess(images, cfg)
    ref_pixels, ref_grid = hf_preprocess(ref, images)
    assert torch.equal(grid, ref_grid)
    assert float((pixels - ref_pixels).abs().max()) <= 1e-6


def test_older_pixel_bounds_win_over_size_as_in_transformers():
    """Older preprocessor_config.json files give min_pixels / max_pixels beside (or instead of) size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    raw = {"patch_size": 16, "merge_size": 2, "min_pixels": 32 * 32 * 8, "max_pixels": 32 * 32 * 12,
           "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 100}}
    image = synthetic_image(300, 200, seed=9)
    pixels, grid = preprocess([image], ImageProcessorConfig.from_dict(raw))
    ref_pixels, ref_grid = hf_preprocess(Qwen2VLImageProcessorPil(**raw), [image])
    assert torch.equal(grid, ref_grid) and torch.equal(pixels, ref_pixels)


def test_image_bytes_decode_and_bad_ones_are_named(tmp_path):
    import io

    buffer = io.BytesIO()
    synthetic_image(50, 40, seed=10).save(buffer, format="PNG")
    assert open_image(buffer.getvalue()).size == (50, 40)
    with pytest.raises(ImageInputError, match="cannot be decoded"):
        open_image(b"GIF89a truncated")
    with pytest.raises(ImageInputError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_folder(tmp_path)


def test_preprocessing_refuses_what_it_cannot_use():
    cfg = ImageProcessorConfig(patch_size=16)
    with pytest.raises(ImageInputError, match="aspect ratio"):
        preprocess([synthetic_image(1005, 5)], cfg)
    with pytest.raises(ImageInputError, match="PIL image"):
        preprocess([b"not an image"], cfg)
    with pytest.raises(ImageInputError, match="No image"):
        preprocess([], cfg)


# ---------------------------------------------------------------------------------------------------- the tower
def tower_from(hf, **kw) -> VisionTower:
    cfg = VisionConfig.from_dict(hf.config.vision_config.to_dict())
    return VisionTower(cfg, {n: t for n, t in hf.state_dict().items() if n.startswith("model.visual.")}, **kw)


def test_vision_tower_matches_transformers_on_two_images_of_different_sizes(vl):
    hf, folder = vl
    images = [synthetic_image(100, 70, seed=3), synthetic_image(37, 251, seed=4)]
    pixels, grid = preprocess(images, ImageProcessorConfig.from_folder(folder))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid).pooler_output
    ours = tower_from(hf)(pixels, grid)
    assert ours.shape == ref.shape == (sum(image_token_count(g, MERGE) for g in grid), 64)
    assert relative(ours, ref) <= 1e-4
    # attention stays within each image: each image alone gives its slice of the batch
    alone = [tower_from(hf)(*preprocess([im], ImageProcessorConfig.from_folder(folder))) for im in images]
    for part, single in zip(split_per_image(ours, grid, MERGE), alone):
        assert relative(part, single) <= 1e-5


def test_vision_tower_in_bf16_and_int8_stays_close(vl):
    hf, folder = vl
    pixels, grid = preprocess([synthetic_image(100, 70, seed=5)], ImageProcessorConfig.from_folder(folder))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid).pooler_output
    assert relative(tower_from(hf, dtype=torch.bfloat16)(pixels, grid), ref) <= 2e-2  # measured 6e-3
    assert relative(tower_from(hf, weight_format="int8")(pixels, grid), ref) <= 2e-2  # measured 1e-2


def test_vision_tower_refuses_inputs_that_do_not_match(vl):
    hf, _ = vl
    tower = tower_from(hf)
    with pytest.raises(ValueError, match="preprocess"):
        tower(torch.zeros(24, 100), torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="multiples of 2"):
        tower(torch.zeros(15, 1536), torch.tensor([[1, 3, 5]]))


def test_load_vision_reads_the_folder(vl, tmp_path):
    hf, folder = vl
    tower = load_vision(folder)
    pixels, grid = preprocess([synthetic_image(64, 64, seed=6)], ImageProcessorConfig.from_folder(folder))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=grid).pooler_output
    assert relative(tower(pixels, grid), ref) <= 1e-4
    # a tensor short: refused, naming it
    tensors = read_vision_tensors(folder)
    del tensors["blocks.1.attn.proj.bias"]
    with pytest.raises(ModelLoadError, match="blocks.1.attn.proj.bias"):
        VisionTower(tower.cfg, tensors)
    # a Qwen3-VL tower (DeepStack) is refused; a text-only folder has none
    with pytest.raises(ModelLoadError, match="DeepStack"):
        VisionConfig.from_dict({"deepstack_visual_indexes": [8, 16, 24]})
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    raw = json.loads((folder / "config.json").read_text())
    (text_only / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "vision_config"}))
    assert load_vision(text_only) is None


# ---------------------------------------------------------------------------------------------------- positions
def test_mrope_positions_match_transformers_get_rope_index(vl):
    hf, _ = vl
    grid = torch.tensor([[1, 4, 6], [1, 16, 2], [1, 2, 2]])
    counts = [image_token_count(g, MERGE) for g in grid]
    ids = vl_prompt(counts, [[1, 2, 3], [4, 5], [], [6, 7, 8, 9]])
    ids_t = torch.tensor([ids])
    types = (ids_t == IMAGE_TOKEN).int()
    ref, ref_delta = hf.model.get_rope_index(ids_t, types, image_grid_thw=grid)
    ours, delta = mrope_positions(ids, grid, IMAGE_TOKEN, MERGE)
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta)
    # after the prompt, every row continues from index + delta
    assert torch.equal(decode_positions(len(ids), 2, delta)[:, 0], torch.full((3,), int(ours.max()) + 1))


def test_mrope_positions_without_images_are_plain():
    ours, delta = mrope_positions([5, 6, 7], torch.zeros(0, 3, dtype=torch.long), IMAGE_TOKEN, MERGE)
    assert torch.equal(ours, torch.arange(3).expand(3, -1)) and delta == 0


def test_mrope_positions_refuse_placeholders_that_disagree():
    grid = torch.tensor([[1, 4, 6]])
    with pytest.raises(ImagePlacementError, match="does not match"):
        mrope_positions(vl_prompt([5], [[1], [2]]), grid, IMAGE_TOKEN, MERGE)
    with pytest.raises(ImagePlacementError, match="more image placeholder"):
        mrope_positions(vl_prompt([6, 6], [[1], [2], [3]]), grid, IMAGE_TOKEN, MERGE)
    with pytest.raises(ImagePlacementError, match="places 0 of its 1"):
        mrope_positions([1, 2, 3], grid, IMAGE_TOKEN, MERGE)


def test_placeholders_expand_to_each_images_token_count():
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    rendered = vl_prompt([1, 1], [[1], [2], [3]])
    assert expand_image_placeholders(rendered, grid, IMAGE_TOKEN, MERGE) == vl_prompt([6, 1], [[1], [2], [3]])
    with pytest.raises(ImagePlacementError, match="1 image placeholder"):
        expand_image_placeholders(vl_prompt([1], [[1], [2]]), grid, IMAGE_TOKEN, MERGE)


def test_mrope_angles_match_transformers_text_rotary(vl):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    hf, _ = vl
    text_cfg = hf.config.text_config
    rotary = Qwen3_5TextRotaryEmbedding(text_cfg)
    grid = torch.tensor([[1, 6, 4]])
    ids = vl_prompt([6], [[1, 2], [3, 4, 5]])
    positions, _ = mrope_positions(ids, grid, IMAGE_TOKEN, MERGE)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])
    angles = mrope_angles(positions, rotary.inv_freq, text_cfg.rope_parameters["mrope_section"])
    emb = torch.cat((angles, angles), dim=-1)
    assert float((emb.cos() - cos[0]).abs().max()) <= 1e-6 and float((emb.sin() - sin[0]).abs().max()) <= 1e-6


# ---------------------------------------------------------------------------------------------------- the full path
@pytest.mark.parametrize("cuts", [[], [5, 13, 17]], ids=["one-shot", "chunks-inside-the-images"])
def test_image_and_text_logits_match_transformers_through_our_text_model(vl, monkeypatch, cuts):
    """Images in, logits out: our tower's embeddings put at the <|image_pad|> rows and our text model rotating by the
    M-RoPE positions; the prompt with two images prefilled at once or in chunks that cut through both images
    (the GDN state carried across), then two decode steps, against transformers' logits. The engine has no seam for
    either yet, so this test stands in for them: the embedding lookup (engine.model.llama.embed_rows: the image rows
    in order, chunk after chunk) and the model's Rotary.tables (indexed by token index) are replaced."""
    import engine.model.llama as llama
    from engine.memory.state import SeqState
    from engine.model.loader import load_weights
    from engine.model.registry import build_model
    from engine.runner import ModelRunner, Work

    hf, folder = vl
    pixels, grid = preprocess([synthetic_image(100, 70, seed=7), synthetic_image(40, 90, seed=8)],
                              ImageProcessorConfig.from_folder(folder))
    image_rows = load_vision(folder)(pixels, grid)
    prompt = vl_prompt([image_token_count(g, MERGE) for g in grid], [[1, 2, 3], [4, 5, 6], [7, 8]])
    ids = prompt + [9, 10]  # two tokens decoded one at a time after the prompt
    positions, _ = mrope_positions(ids, grid, IMAGE_TOKEN, MERGE)
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        ref = hf(input_ids=ids_t, pixel_values=pixels, image_grid_thw=grid,
                 mm_token_type_ids=(ids_t == IMAGE_TOKEN).int()).logits[0].float()

    model = build_model(load_weights(folder)[1], torch.float32, torch.device("cpu"))
    section = hf.config.text_config.rope_parameters["mrope_section"]
    placed = [0]  # image rows put in so far

    def mrope_tables(token_index, max_position):
        angles = mrope_angles(positions[:, token_index], model.rotary.inv_freq, section)
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    def embed_with_images(table, token_ids):
        rows = real_embed(table, token_ids)
        is_image = token_ids == IMAGE_TOKEN
        n = int(is_image.sum())
        if n:
            rows = rows.clone()
            rows[is_image] = image_rows[placed[0]:placed[0] + n].to(rows.dtype)
            placed[0] += n
        return rows

    real_embed = llama.embed_rows
    monkeypatch.setattr(llama, "embed_rows", embed_with_images)
    monkeypatch.setattr(model.rotary, "tables", mrope_tables)
    runner = ModelRunner(model, 4, torch.float32, 64, state_slots=1)
    pages, state = runner.pool.allocate(2), SeqState(runner.state.allocate())
    bounds = [0, *cuts, *range(len(prompt), len(ids) + 1)]
    rows = [runner.run([Work(ids[a:b], a, pages, "all", state)])[0] for a, b in zip(bounds, bounds[1:])]
    assert placed[0] == image_rows.shape[0]
    assert relative(torch.cat(rows), ref) <= 1e-4  # measured 5e-7
