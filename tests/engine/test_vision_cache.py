"""Images and the caches (issue #36): prefix pages and recurrent-state snapshots keyed by the images' content hashes
(a resent image reuses its prefix, another image at the same place never does), the encoder cache (the tower runs
once per image within its bound), --max-image-pixels, the ledger's vision lines, and speculation beside images.
The oracle is transformers' Qwen3_5ForConditionalGeneration on the tiny seeded VL checkpoint."""
from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.build import assemble_engine, load_model
from engine.ledger import ModelShape, build_ledger
from engine.ledger.vision import ENCODER_CACHE_IMAGES
from engine.model.encoder_cache import EncoderCache
from engine.model.image_keys import KEY_BASE, KeyTokens
from engine.model.image_processing import ImageProcessorConfig, image_token_count, preprocess
from engine.sampling import SamplingParams
from tests.engine.test_vision_engine import (  # noqa: F401 - vl is the module's fixture
    hf_greedy, hf_logits, png, recorded_logits, relative, vl)
from tests.engine.vision_models import IMAGE_TOKEN, MERGE, MIN_PIXELS, image_processor, synthetic_image, vl_prompt

FOUR = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SIZE = (224, 160)  # 35 image tokens with the checkpoint's processor


def conversation(folder, image, before: list[int], after: list[int]):
    """(pixel_values, grid_thw, prompt) of `before`, the image, `after`."""
    pixels, grid = preprocess([image], ImageProcessorConfig.from_folder(folder))
    return pixels, grid, vl_prompt([image_token_count(grid[0], MERGE)], [before, after])


def answer(engine, prompt, images, params=FOUR):
    """(tokens, cached_tokens) of one request."""
    tokens, cached = [], None
    for out in engine.submit(prompt, params, images=images):
        tokens += out.token_ids
        cached = out.cached_tokens
    return tokens, cached


class CountingTower:
    """The tower, counting the images it runs for (VisionModel.embed calls it once an image)."""

    def __init__(self, tower):
        self.tower, self.calls = tower, 0

    def __getattr__(self, name):
        return getattr(self.tower, name)

    def __call__(self, pixels, grid):
        self.calls += int(grid.shape[0])
        return self.tower(pixels, grid)


@pytest.fixture
def counted(vl, monkeypatch):
    """The module's model with a fresh encoder cache and a counting tower (undone after the test)."""
    _, _, model = vl
    tower = CountingTower(model.vision.tower)
    monkeypatch.setattr(model.vision, "tower", tower)
    monkeypatch.setattr(model.vision, "encoder_cache", EncoderCache(model.vision.encoder_cache.max_bytes))
    return tower


def test_a_resent_image_reuses_its_prefix_with_the_same_logits(vl, counted):
    """The same conversation sent twice (image as PNG bytes both times): the second reuses 128 cached tokens (two
    full pages, the image inside the first) with no tower run at all, and its logits equal the first run's, a
    fresh engine's and transformers'."""
    hf, folder, model = vl
    image = synthetic_image(*SIZE, seed=7)
    pixels, grid, prompt = conversation(folder, image, [3, 4, 5], [*range(6, 110)])
    engine = assemble_engine(model).engine.start()
    try:
        rows = recorded_logits(engine)
        first, cached_first = answer(engine, prompt, [png(image)])
        calls = counted.calls
        second, cached_second = answer(engine, prompt, [png(image)])
    finally:
        engine.shutdown()
    fresh = assemble_engine(model).engine.start()
    try:
        fresh_rows = recorded_logits(fresh)
        again, _ = answer(fresh, prompt, [png(image)])
    finally:
        fresh.shutdown()
    assert cached_first == 0 and cached_second == len(prompt) - 1 - (len(prompt) - 1) % 64 == 128
    assert calls == 1 and counted.calls == 2 - 1  # the reused prefix holds the whole image: no rows needed
    assert first == second == again == hf_greedy(hf, prompt, pixels, grid, 4)
    ref = hf_logits(hf, prompt + first[:-1], pixels, grid)[len(prompt) - 1:]
    first_rows, second_rows = torch.cat(rows[:4]), torch.cat(rows[4:8])
    assert relative(second_rows, first_rows) <= 1e-5 and relative(second_rows, torch.cat(fresh_rows)) <= 1e-5
    assert relative(second_rows, ref) <= 1e-4  # measured 2.2e-7 (other chunking, not bit-equal) and 2.9e-7


def test_a_snapshot_inside_an_image_resumes_there(vl):
    """The recurrent state resumed inside an image run: the first request computes its prompt in chunks of 70 (a
    state snapshot at 64, inside the image at 41..75), the second shares the text and the image but not the text
    after it. It resumes at 64, mid-image (its M-RoPE positions there equal the first's), and its tokens and logits
    are transformers' for its own prompt."""
    hf, folder, model = vl
    image = synthetic_image(*SIZE, seed=7)
    before = [*range(3, 43)]
    _, _, first_prompt = conversation(folder, image, before, [*range(6, 40)])
    pixels, grid, prompt = conversation(folder, image, before, [*range(120, 170)])
    start = first_prompt.index(IMAGE_TOKEN)
    assert start < 64 < start + 35
    engine = assemble_engine(model, prefill_chunk=70).engine.start()
    try:
        answer(engine, first_prompt, [image])
        rows = recorded_logits(engine)
        tokens, cached = answer(engine, prompt, [image])
    finally:
        engine.shutdown()
    assert cached == 64
    a, b = model.vision.prepare(first_prompt, [image]), model.vision.prepare(prompt, [image])
    assert torch.equal(a.positions[:, :64], b.positions[:, :64])
    assert tokens == hf_greedy(hf, prompt, pixels, grid, 4)
    ref = hf_logits(hf, prompt + tokens[:-1], pixels, grid)[len(prompt) - 1:]
    assert relative(torch.cat(rows[-4:]), ref) <= 1e-4  # measured 2.8e-7


def test_a_different_image_at_the_same_place_matches_only_the_text_before_it(vl):
    """Image B (same size, other pixels) where image A was, after 70 tokens of text: the key tokens agree exactly up
    to the image; the prefix cache matches the first page (text only) and nothing past it, the engine reuses no
    more than the text before the image, and B's logits are transformers' for B (not A's)."""
    hf, folder, model = vl
    image_a, image_b = synthetic_image(*SIZE, seed=7), synthetic_image(*SIZE, seed=99)
    before, after = [*range(3, 73)], [*range(6, 60)]
    _, _, prompt = conversation(folder, image_a, before, after)
    pixels_b, grid_b, prompt_b = conversation(folder, image_b, before, after)
    assert prompt == prompt_b
    keys = [KeyTokens(prompt, p.image_at.tolist(), p.key_ids)
            for p in (model.vision.prepare(prompt, [png(image_a)]), model.vision.prepare(prompt, [png(image_b)]))]
    start = prompt.index(IMAGE_TOKEN)
    assert keys[0][:start] == keys[1][:start] == prompt[:start]
    assert all(x != y and x >= KEY_BASE and y >= KEY_BASE for x, y in zip(keys[0][start:start + 35],
                                                                          keys[1][start:start + 35]))
    engine = assemble_engine(model, prefill_chunk=64).engine.start()
    try:
        answer(engine, prompt, [png(image_a)])
        assert len(engine.memory.attention.prefix.match(keys[0])) == 2  # A's pages are cached, image included
        assert len(engine.memory.attention.prefix.match(keys[1])) == 1  # only the text page matches B
        rows = recorded_logits(engine)
        tokens, cached = answer(engine, prompt_b, [png(image_b)])
    finally:
        engine.shutdown()
    assert cached <= start
    assert tokens == hf_greedy(hf, prompt_b, pixels_b, grid_b, 4)
    ref_b = hf_logits(hf, prompt_b + tokens[:-1], pixels_b, grid_b)[len(prompt_b) - 1:]
    assert relative(torch.cat(rows), ref_b) <= 1e-4  # measured 2.9e-7


def test_the_encoder_cache_skips_the_tower_for_a_resent_image_and_evicts_beyond_its_bound(vl, counted):
    """The same image after other text (no prefix to reuse): its rows come from the encoder cache, the tower is not
    called, the answer is transformers'. With a bound of one image's rows, A then B evicts A: A again runs the
    tower."""
    hf, folder, model = vl
    image_a, image_b = synthetic_image(*SIZE, seed=7), synthetic_image(*SIZE, seed=99)
    engine = assemble_engine(model).engine.start()
    try:
        answer(engine, conversation(folder, image_a, [3, 4], [5, 6])[2], [png(image_a)])
        assert counted.calls == 1
        pixels, grid, prompt = conversation(folder, image_a, [9, 8, 7, 6], [5, 4, 3])
        tokens, cached = answer(engine, prompt, [png(image_a)])
        assert counted.calls == 1 and cached == 0
        assert tokens == hf_greedy(hf, prompt, pixels, grid, 4)
        cache = model.vision.encoder_cache
        one_image = cache.bytes
        assert len(cache) == 1 and one_image == 35 * 64 * 4  # 35 rows of the text model's 64, fp32
        cache.max_bytes = one_image
        answer(engine, conversation(folder, image_b, [10], [11])[2], [png(image_b)])
        answer(engine, conversation(folder, image_a, [12], [13])[2], [png(image_a)])
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert counted.calls == 3 and stats["encoder_cache_evictions"] == 2 and stats["encoder_cache_images"] == 1


def test_max_image_pixels_scales_a_big_image_to_fit(vl):
    """--max-image-pixels below the processor's own max_pixels: a 400 x 300 image gets the grid and pixel values of
    transformers' image processor with max_pixels set to it, and transformers' greedy tokens; above it, the
    processor's own bound holds."""
    hf, folder, _ = vl
    limit = 32 * 32 * 12
    image = synthetic_image(400, 300, seed=3)
    model = load_model(folder, device="cpu", max_context=256, max_concurrency=1, max_image_pixels=limit)
    ref = image_processor(size={"shortest_edge": MIN_PIXELS, "longest_edge": limit})(images=[image],
                                                                                    return_tensors="pt")
    prepared_prompt = vl_prompt([image_token_count(ref["image_grid_thw"][0], MERGE)], [[3, 4], [5, 6]])
    prepared = model.vision.prepare(prepared_prompt, [image])
    assert torch.equal(prepared.grid_thw, ref["image_grid_thw"])
    assert int(prepared.grid_thw[0].prod()) * 16 * 16 <= limit
    assert torch.allclose(prepared.pixel_values, ref["pixel_values"], atol=1e-6)
    engine = assemble_engine(model).engine.start()
    try:
        tokens, _ = answer(engine, prepared_prompt, [image])
    finally:
        engine.shutdown()
    assert tokens == hf_greedy(hf, prepared_prompt, ref["pixel_values"], ref["image_grid_thw"], 4)
    roomy = load_model(folder, device="cpu", max_context=256, max_concurrency=1, max_image_pixels=10**8)
    assert roomy.vision.processor == ImageProcessorConfig.from_folder(folder)


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors the ops under it had made and not yet freed at once (a storage counted once)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.refs = 0, 0, {}

    def _drop(self, ptr):
        nbytes, refs = self.refs[ptr]
        if refs == 1:
            del self.refs[ptr]
            self.live -= nbytes
        else:
            self.refs[ptr] = (nbytes, refs - 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.refs and any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
                                                for a in tree_flatten((args, kwargs))[0]):
                    continue  # a view of a tensor made outside (the weights, the caller's input)
                nbytes, refs = self.refs.get(ptr, (t.untyped_storage().nbytes(), 0))
                if not refs:
                    self.live += nbytes
                self.refs[ptr] = (nbytes, refs + 1)
                weakref.finalize(t, self._drop, ptr)
        self.peak = max(self.peak, self.live)
        return out


def test_the_ledger_counts_the_tower_its_activations_and_the_encoder_cache(vl):
    """The VL folder's ledger against its text part's: its RAM total is larger by the tower's bytes (summed over the
    loaded tower's own tensors), its activations for the largest image (at least what a forward over an image of
    the processor's max_pixels holds live, measured, and at most 3x that) and the encoder cache (4 such images'
    rows, the size the engine's cache is bounded by); the KV is the text model's."""
    _, folder, model = vl
    shape = ModelShape.from_path(folder)
    assert shape.vision is not None
    settings = dict(vram_mib=0, ram_mib=64 * 1024, kv_capacity=4096, max_context=512)
    with_vision, text = build_ledger(shape, **settings), build_ledger(replace(shape, vision=None), **settings)
    tower = model.vision.tower
    tensors = [tower.patch_embed.weight, tower.patch_embed.bias, tower.pos_table, *tower.merger_norm,
               tower.merger_fc1.weight, tower.merger_fc1.bias, tower.merger_fc2.weight, tower.merger_fc2.bias]
    for b in tower.blocks:
        tensors += [*b.norm1, *b.norm2] + [t for v in (b.qkv, b.proj, b.fc1, b.fc2) for t in (v.weight, v.bias)]
    tower_bytes = sum(t.numel() * t.element_size() for t in tensors)
    assert with_vision.line("vision").bytes == tower_bytes
    processor = model.vision.processor
    side = int(processor.max_pixels ** 0.5) // 32 * 32
    image = synthetic_image(side, processor.max_pixels // side // 32 * 32, seed=5)
    pixels, grid = preprocess([image], processor)
    assert int(grid[0].prod()) == processor.max_pixels // 256 == shape.vision.patches(10**9)
    pixels = pixels.double()  # so the tower's own copy in its dtype counts, as the device copy would
    with LiveBytes() as measured:
        tower(pixels, grid)
    activations = with_vision.line("vision_activations").bytes
    assert measured.peak <= activations <= 3 * measured.peak  # measured 1,204,224 B, the estimate 1,609,728 B
    cache = with_vision.line("encoder_cache")
    assert cache.device == "host" and cache.bytes == ENCODER_CACHE_IMAGES * shape.vision.tokens(10**9) * 64 * 4
    assert cache.bytes == model.vision.encoder_cache.max_bytes
    assert with_vision.total("host") - text.total("host") == tower_bytes + activations + cache.bytes
    assert with_vision.line("kv").bytes == text.line("kv").bytes
    assert any("Image tokens are prompt tokens" in note for note in with_vision.notes)


class _Machine:
    """A CPU-only machine, as engine.hardware's report describes it to the launcher."""
    ram_total_mib, ram_available_mib = 16384, 8192

    def usable_gpu(self):
        return None


def test_the_launcher_estimate_shows_the_vision_lines(vl):
    """The app's launcher bars (app/launcher/estimate.py) of the VL folder: the tower in the weights segment, its
    activations and encoder cache in the workspace one, so the RAM bar adds up to the ledger's total."""
    from app.launcher.estimate import estimate, model_info
    from engine.config.engine_config import EngineConfig

    _, folder, _ = vl
    info = model_info(folder)
    mem = estimate(info, EngineConfig(device="cpu", max_context=512), _Machine())
    ledger = mem.ledger
    assert ledger.line("vision") and ledger.line("vision_activations") and ledger.line("encoder_cache")
    [bar] = mem.bars()
    segments = {s.key: s.bytes for s in bar.segments}
    assert sum(segments.values()) == ledger.total("host")
    assert segments["weights"] == ledger.line("weights").bytes + ledger.line("vision").bytes


def test_ngram_speculation_beside_an_image_gives_the_greedy_tokens(vl):
    """--spec ngram: a request with an image (decoded without drafts: its drafter would not know its M-RoPE
    positions) gives exactly the tokens of the engine without speculation and transformers' greedy tokens; a
    text-only request beside it speculates (drafts counted) and is unchanged too."""
    hf, folder, model = vl
    image = synthetic_image(*SIZE, seed=7)
    pixels, grid, prompt = conversation(folder, image, [3, 4, 5, 3, 4, 5], [3, 4, 5, 3, 4, 5, 3, 4])
    text = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    for spec in ("none", "ngram"):
        engine = assemble_engine(model, spec=spec).engine
        if engine.speculator is not None:
            engine.speculator.adaptive = False  # drafts at full length wherever the n-grams match
        engine.start()
        try:
            with_image, alone = engine.submit(prompt, params, images=[image]), engine.submit(text, params)
            results[spec] = ([t for o in with_image for t in o.token_ids], [t for o in alone for t in o.token_ids])
            stats = engine.stats()
        finally:
            engine.shutdown()
    assert results["ngram"] == results["none"]
    assert results["none"][0] == hf_greedy(hf, prompt, pixels, grid, 32)
    assert results["none"][1] == hf_greedy(hf, text, n=32)
    assert stats.get("spec_drafted", 0) > 0  # measured: 12 drafted, 1 accepted


@pytest.fixture(scope="module")
def vl_mtp(vl, tmp_path_factory):
    """The tiny VL checkpoint with one random MTP block (shaped as its attention layer, as Qwen3.5's published
    mtp.* tensors are), loaded once: (transformers model, folder, LoadedModel)."""
    import shutil

    from safetensors.torch import load_file

    from tests.engine.spec_models import add_tensors

    hf, folder, _ = vl
    copy = shutil.copytree(folder, tmp_path_factory.mktemp("vl-mtp") / "tiny-vl-mtp")
    tensors = load_file(next(copy.glob("*.safetensors")))
    prefix = next(n for n in tensors if n.endswith("layers.3.self_attn.q_proj.weight")).removesuffix("self_attn.q_proj.weight")
    g = torch.Generator().manual_seed(11)
    hidden = hf.config.text_config.hidden_size
    mtp = {f"mtp.layers.0.{n.removeprefix(prefix)}": (0.3 if n.endswith("norm.weight") else 0.1)
           * torch.randn(t.shape, generator=g) for n, t in tensors.items() if n.startswith(prefix)}
    mtp |= {"mtp.fc.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
            **{f"mtp.{n}.weight": 0.3 * torch.randn(hidden, generator=g)
               for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    add_tensors(copy, mtp)
    return hf, copy, load_model(copy, device="cpu", max_context=512, max_concurrency=2)


def test_mtp_speculation_beside_an_image_gives_the_greedy_tokens(vl_mtp):
    """--spec mtp: a request with an image decodes without drafts (the MTP block would rotate at the index, not at
    index + delta) and gives the tokens of the engine without speculation and transformers' greedy tokens; a
    text-only request beside it drafts with the block (drafts counted, states rolled back) and is unchanged too."""
    hf, folder, model = vl_mtp
    image = synthetic_image(*SIZE, seed=7)
    pixels, grid, prompt = conversation(folder, image, [3, 4, 5, 3, 4, 5], [3, 4, 5, 3, 4, 5, 3, 4])
    text = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results, stats = {}, {}
    for spec in ("none", "mtp"):  # mtp last: its engine takes the block's tensors
        engine = assemble_engine(model, spec=spec, draft_tokens=3).engine if spec == "mtp" else \
            assemble_engine(model).engine
        if engine.speculator is not None:
            engine.speculator.adaptive = False
        engine.start()
        try:
            with_image, alone = engine.submit(prompt, params, images=[image]), engine.submit(text, params)
            results[spec] = ([t for o in with_image for t in o.token_ids], [t for o in alone for t in o.token_ids])
            stats[spec] = engine.stats()
        finally:
            engine.shutdown()
    assert results["mtp"] == results["none"]
    assert results["none"][0] == hf_greedy(hf, prompt, pixels, grid, 32)
    assert results["none"][1] == hf_greedy(hf, text, n=32)
    assert stats["mtp"]["spec_method"] == "mtp" and stats["mtp"]["spec_drafted"] > 0
