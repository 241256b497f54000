"""A GGUF model's vision tower from llama.cpp's mmproj file (issue #36): the tiny Qwen3.5 VL checkpoint written as
llama.cpp's converter writes it (tests/engine/mmproj_writer.py: a qwen35 text GGUF and an mmproj GGUF beside it)
gives transformers' logits and greedy tokens (Qwen3_5ForConditionalGeneration fp32, the oracle: its cached generate,
logits per step) and the HF-folder engine's, for one and for two images; the projector file is found beside the
model or named with --mmproj; the wrong projector type, another model's hidden size and missing tensors are refused
with what to do; the model library lists a repository with an mmproj file as one vision-capable model."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine.build import assemble_engine, load_model
from engine.errors import NInferError
from engine.model.gguf_mmproj import (PUBLISHED_MAX_PIXELS, PUBLISHED_MIN_PIXELS, MmprojError, find_mmproj,
                                      read_mmproj)
from engine.model.image_processing import ImageProcessorConfig, image_token_count, preprocess
from engine.model.vision import VisionTower
from engine.model.vision_input import ImagesNotSupportedError
from tests.engine.mmproj_writer import round_vision_to_f16, write_mmproj, write_text_gguf
from tests.engine.test_vision_engine import CASES, GREEDY, png, recorded_logits, relative
from tests.library.conftest import hf_home, hub  # noqa: F401  (fixtures: the stand-in hub on the loopback)
from tests.engine.vision_models import IMAGE_TOKEN, MERGE, image_processor, synthetic_image, tiny_vl_checkpoint, \
    vl_prompt

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Qwen3.5's published preprocessor_config.json `size`: what a GGUF model reads where its mmproj file has no bounds
PUBLISHED_SIZE = {"shortest_edge": PUBLISHED_MIN_PIXELS, "longest_edge": PUBLISHED_MAX_PIXELS}
TEXT_GGUF, MMPROJ = "tiny-vl-F32.gguf", "mmproj-tiny-vl-F32.gguf"


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(transformers model, HF folder, GGUF folder): the folder's image processor with Qwen3.5's published bounds
    (so both forms preprocess alike), the GGUF folder holding the text GGUF and one mmproj file."""
    root = tmp_path_factory.mktemp("vl-mmproj")
    hf, folder = tiny_vl_checkpoint(root / "tiny-vl")
    image_processor(size=PUBLISHED_SIZE).save_pretrained(folder)
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    write_text_gguf(hf, gguf_dir / TEXT_GGUF)
    write_mmproj(hf, gguf_dir / MMPROJ)
    return hf, folder, gguf_dir


@pytest.fixture(scope="module")
def models(vl):
    """(GGUF LoadedModel, HF-folder LoadedModel), loaded once for the module."""
    _, folder, gguf_dir = vl
    settings = dict(device="cpu", max_context=512, max_concurrency=2)
    return load_model(gguf_dir / TEXT_GGUF, **settings), load_model(folder, **settings)


def request(folder, case: str):
    sizes, text = CASES[case]
    images = [synthetic_image(w, h, seed=s) for w, h, s in sizes]
    pixels, grid = preprocess(images, ImageProcessorConfig.from_folder(folder))
    return images, pixels, grid, vl_prompt([image_token_count(g, MERGE) for g in grid], text)


def engine_greedy(model, prompt, images) -> tuple[list[int], torch.Tensor]:
    """32 greedy tokens and every step's logits row."""
    engine = assemble_engine(model).engine.start()
    try:
        rows = recorded_logits(engine)
        out = engine.generate(prompt, GREEDY, images=[png(i) for i in images])
    finally:
        engine.shutdown()
    return out, torch.cat(rows)


def hf_generate(hf, prompt, pixels, grid) -> tuple[list[int], torch.Tensor]:
    """transformers' cached greedy generate: its tokens and each step's logits (a generated <|image_pad|> is text
    there, as in the engine, where a forward over the whole sequence would count it as a placeholder)."""
    t = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(input_ids=t, pixel_values=pixels, image_grid_thw=grid,
                          mm_token_type_ids=(t == IMAGE_TOKEN).int(), max_new_tokens=32, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_with_mmproj_matches_transformers_and_the_folder_engine(vl, models, case):
    hf, folder, _ = vl
    gguf_model, folder_model = models
    assert gguf_model.vision is not None and gguf_model.vision.image_token_id == IMAGE_TOKEN
    images, pixels, grid, prompt = request(folder, case)
    tokens, rows = engine_greedy(gguf_model, prompt, images)
    ref_tokens, ref_rows = hf_generate(hf, prompt, pixels, grid)
    assert tokens == ref_tokens
    assert relative(rows, ref_rows) <= 1e-4  # measured 2.6e-7 (one image), 2.7e-7 (two)
    folder_tokens, folder_rows = engine_greedy(folder_model, prompt, images)
    assert tokens == folder_tokens
    assert torch.equal(rows, folder_rows)  # the same weights, read from either form: bit for bit


def test_the_tower_tensors_read_back_as_transformers_holds_them(vl):
    """Every model.visual.* tensor exactly, the Conv3d's temporal slices in their order (images repeat their frame
    over both, so only this shows a swap) and the fused qkv as it is; the config as transformers' vision_config."""
    hf, _, gguf_dir = vl
    cfg, tensors, _ = read_mmproj(gguf_dir / MMPROJ, 64)
    state = {n.removeprefix("model.visual."): t for n, t in hf.state_dict().items() if n.startswith("model.visual.")}
    assert set(tensors) == set(state)
    assert all(torch.equal(tensors[n], state[n].float()) for n in state)
    v = hf.config.vision_config
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.patch_size, cfg.spatial_merge_size,
            cfg.out_hidden_size, cfg.num_position_embeddings, cfg.hidden_act) == \
        (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.patch_size, v.spatial_merge_size,
         v.out_hidden_size, v.num_position_embeddings, v.hidden_act)


def test_the_image_processor_comes_from_the_file(vl, tmp_path):
    """Mean, std, patch and merge from the file and Qwen3.5's published pixel bounds: the processor the folder's
    transformers preprocessor_config.json describes; bounds written in the file win."""
    hf, folder, gguf_dir = vl
    _, _, processor = read_mmproj(gguf_dir / MMPROJ, 64)
    assert processor == ImageProcessorConfig.from_folder(folder)
    path = write_mmproj(hf, tmp_path / "mmproj-bounds.gguf", pixels=(4096, 8192), mean=(0.1, 0.2, 0.3))
    _, _, bounded = read_mmproj(path, 64)
    assert (bounded.min_pixels, bounded.max_pixels) == (4096, 8192)
    assert bounded.image_mean == pytest.approx((0.1, 0.2, 0.3))


def test_an_f16_mmproj_matches_its_f16_transformers_twin(vl, tmp_path):
    """--outtype f16: matrices and the patch slices stored F16; the tower equals transformers' with those
    matrices rounded to fp16 (and differs from the F32 tower, so the F16 values are what is read)."""
    import gguf

    hf, folder, _ = vl
    path = write_mmproj(hf, tmp_path / "mmproj-F16.gguf", f16=True)
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert kinds["v.patch_embd.weight.1"] == kinds["v.blk.0.attn_qkv.weight"] == gguf.GGMLQuantizationType.F16
    cfg, tensors, _ = read_mmproj(path, 64)
    images = [synthetic_image(100, 70, seed=3), synthetic_image(40, 90, seed=4)]
    pixels, grid = preprocess(images, ImageProcessorConfig.from_folder(folder))
    ours = VisionTower(cfg, tensors)(pixels, grid)
    twin = type(hf)(hf.config).eval()
    twin.load_state_dict(hf.state_dict())
    round_vision_to_f16(twin)
    with torch.no_grad():
        ref, full = twin.model.visual(pixels, grid_thw=grid).pooler_output, hf.model.visual(pixels, grid_thw=grid)
    assert relative(ours, ref) <= 1e-5  # measured 5.4e-7
    assert relative(ours, full.pooler_output) > 1e-4  # measured 4.0e-4


def test_the_mmproj_file_is_found_beside_the_model_or_named(vl, tmp_path):
    _, _, gguf_dir = vl
    model = gguf_dir / TEXT_GGUF
    assert find_mmproj(model, "") == gguf_dir / MMPROJ
    assert find_mmproj(model, str(gguf_dir / MMPROJ)) == gguf_dir / MMPROJ
    with pytest.raises(MmprojError, match="no such file") as e:
        find_mmproj(model, str(tmp_path / "missing.gguf"))
    assert "--mmproj" in e.value.remedy
    two = tmp_path / "two"
    two.mkdir()
    for name in (TEXT_GGUF, MMPROJ, "mmproj-tiny-vl-F16.gguf"):
        shutil.copy(gguf_dir / (MMPROJ if name.startswith("mmproj") else name), two / name)
    with pytest.raises(MmprojError, match="2 vision projector files") as e:
        find_mmproj(two / TEXT_GGUF, "")
    assert "mmproj-tiny-vl-F16.gguf" in e.value.problem and MMPROJ in e.value.problem
    assert "--mmproj" in e.value.remedy
    assert find_mmproj(two / TEXT_GGUF, str(two / MMPROJ)) == two / MMPROJ  # naming one settles it


def test_a_text_gguf_without_mmproj_stays_text_only(vl, tmp_path):
    hf, folder, gguf_dir = vl
    alone = tmp_path / TEXT_GGUF
    shutil.copy(gguf_dir / TEXT_GGUF, alone)
    model = load_model(alone, device="cpu", max_context=512)
    assert model.vision is None
    images, _, _, prompt = request(folder, "one image")
    engine = assemble_engine(model).engine.start()
    try:
        with pytest.raises(ImagesNotSupportedError):
            engine.submit(prompt, GREEDY, images=[png(images[0])])
        assert len(engine.generate([3, 4, 5], GREEDY)) == 32  # text still runs
    finally:
        engine.shutdown()


def test_mmproj_with_a_folder_model_is_refused(vl):
    _, folder, gguf_dir = vl
    with pytest.raises(NInferError, match="model folder") as e:
        load_model(folder, device="cpu", max_context=512, mmproj=str(gguf_dir / MMPROJ))
    assert "Drop --mmproj" in e.value.remedy


@pytest.mark.parametrize("kind", ["projector", "hidden size", "missing block tensor", "missing patch slice",
                                  "more blocks than its keys"])
def test_mmproj_files_that_cannot_be_this_tower_are_refused(vl, tmp_path, kind):
    hf, _, gguf_dir = vl
    arguments, problem, remedy = {
        "projector": (dict(projector="qwen2.5vl_merger"), "projector type 'qwen2.5vl_merger'", "mmproj file made"),
        "hidden size": (dict(projection_dim=32), "projects images to 32 values.*hidden size is 64", "own repository"),
        "missing block tensor": (dict(skip=("v.blk.1.attn_qkv.weight",)), "v.blk.1.attn_qkv.weight are missing",
                                 "download the repository's mmproj"),
        "missing patch slice": (dict(skip=("v.patch_embd.weight.1",)), "v.patch_embd.weight.1 are missing",
                                "download the repository's mmproj"),
        "more blocks than its keys": (dict(block_count=1), "v.blk.1.attn_out.bias, .* are not part of a Qwen3.5 "
                                      "vision tower of 1 blocks", "mmproj file made"),
    }[kind]
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(gguf_dir / TEXT_GGUF, folder / TEXT_GGUF)
    broken = write_mmproj(hf, folder / "mmproj-broken.gguf", **arguments)
    named = str(broken) if kind == "projector" else ""  # found beside the model, another projector: next test
    with pytest.raises(MmprojError, match=problem) as e:
        load_model(folder / TEXT_GGUF, device="cpu", max_context=512, mmproj=named)
    assert remedy in e.value.remedy


@pytest.mark.parametrize("kind", ["another projector", "not a projector"])
def test_a_foreign_projector_beside_the_model_leaves_it_text_only(vl, tmp_path, caplog, kind):
    """Other models' repositories ship their own mmproj files (LLaVA, Gemma 3): beside a model, not named, such a
    file is passed over, saying so, and the model serves text."""
    from tests.engine.test_qwen35_formats import write_qwen35_gguf

    hf, _, gguf_dir = vl
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(gguf_dir / TEXT_GGUF, folder / TEXT_GGUF)
    if kind == "another projector":
        write_mmproj(hf, folder / "mmproj-gemma3.gguf", projector="gemma3")
    else:  # a text GGUF under a projector's name
        write_qwen35_gguf({}, hf.config.text_config, folder / "mmproj-text.gguf")
    with caplog.at_level("WARNING", logger="ninfer.model"):
        model = load_model(folder / TEXT_GGUF, device="cpu", max_context=512)
    assert model.vision is None
    assert any("requests with images are refused" in r.getMessage() and "mmproj-" in r.getMessage()
               for r in caplog.records)


def _hf_cache_repo(cache, repo_id: str, files: dict) -> None:
    """A repository in the hub cache laid out as huggingface_hub lays it out: blobs by hash, a snapshot of links."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))


def test_the_library_lists_a_repository_with_an_mmproj_as_one_vision_model(vl, tmp_path, capsys):
    from engine.library import cli, local

    _, _, gguf_dir = vl
    cache = tmp_path / "hub"
    _hf_cache_repo(cache, "test-org/Tiny-VL-GGUF", {TEXT_GGUF: gguf_dir / TEXT_GGUF, MMPROJ: gguf_dir / MMPROJ})
    _hf_cache_repo(cache, "test-org/Tiny-Text-GGUF", {TEXT_GGUF: gguf_dir / TEXT_GGUF})
    models = {m.name: m for m in local.hf_cache_models(cache)}
    assert set(models) == {f"test-org/Tiny-VL-GGUF/{TEXT_GGUF}", f"test-org/Tiny-Text-GGUF/{TEXT_GGUF}"}
    vision = models[f"test-org/Tiny-VL-GGUF/{TEXT_GGUF}"]
    assert vision.vision and vision.mmproj.name == MMPROJ and vision.mmproj.parent == vision.path.parent
    assert vision.architecture == "qwen35" and vision.supported
    assert not models[f"test-org/Tiny-Text-GGUF/{TEXT_GGUF}"].vision
    # the engine finds the same file beside the snapshot's model link
    assert find_mmproj(vision.path, "") == vision.mmproj
    # a folder of one's own likewise, and the listing says so
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(gguf_dir / TEXT_GGUF, mine / TEXT_GGUF)
    shutil.copy(gguf_dir / MMPROJ, mine / MMPROJ)
    assert [(m.name, m.vision) for m in local.folder_models(mine)] == [(TEXT_GGUF, True)]
    cli.main(["list", str(mine)])
    lines = capsys.readouterr().out.splitlines()
    assert any(TEXT_GGUF in line and f"vision ({MMPROJ})" in line for line in lines)
    assert not any(line.split()[1].startswith("mmproj") for line in lines if line.strip())


def test_the_hub_listing_folds_the_mmproj_into_its_models():
    from engine.library.hub import HubFile, with_projectors

    def f(name: str) -> HubFile:
        return HubFile("org/repo", name, 1, "", "")

    files = [f("Tiny-Q4_K_M.gguf"), f("Tiny-Q8_0.gguf"), f("mmproj-BF16.gguf"), f("mmproj-F16.gguf"),
             f("text/Other-Q4_0.gguf")]
    listed = {h.filename: h.mmproj.filename if h.mmproj else None for h in with_projectors(files)}
    assert listed == {"Tiny-Q4_K_M.gguf": "mmproj-BF16.gguf", "Tiny-Q8_0.gguf": "mmproj-BF16.gguf",
                      "text/Other-Q4_0.gguf": None}



def test_resolving_an_hf_reference_downloads_the_mmproj_beside_the_model(vl, hub, hf_home):
    """hf:ORG/REPO:QUANT of a repository with a projector: both files in one snapshot folder, where the engine looks;
    listed from the cache as one vision-capable model."""
    from engine.library import local
    from engine.library.resolve import resolve_hf
    from tests.library.conftest import Repo

    _, _, gguf_dir = vl
    hub.add(Repo("test-org/Tiny-VL-GGUF", {"Tiny-VL-F32.gguf": (gguf_dir / TEXT_GGUF).read_bytes(),
                                           "mmproj-Tiny-VL-F32.gguf": (gguf_dir / MMPROJ).read_bytes()},
                 architecture="qwen35"))
    path = resolve_hf("hf:test-org/Tiny-VL-GGUF:F32")
    assert path.name == "Tiny-VL-F32.gguf"
    assert find_mmproj(path, "") == path.parent / "mmproj-Tiny-VL-F32.gguf"
    assert (path.parent / "mmproj-Tiny-VL-F32.gguf").read_bytes() == (gguf_dir / MMPROJ).read_bytes()
    listed = [(m.name, m.vision) for m in local.hf_cache_models()]
    assert listed == [("test-org/Tiny-VL-GGUF/Tiny-VL-F32.gguf", True)]


def test_the_ledger_counts_the_mmproj_tower_beside_a_gguf(vl, models, tmp_path):
    """The launcher's and ninfer-doctor's ledger (ModelShape.from_path, metadata only) of the GGUF finds the
    mmproj beside it: the same tower lines as the HF folder's, and as the loaded tower's own shape; the text GGUF
    alone has none."""
    from engine.build import vision_shape
    from engine.config.engine_config import EngineConfig
    from engine.ledger import ModelShape, build_ledger

    _, folder, gguf_dir = vl
    from_gguf, from_folder = ModelShape.from_path(gguf_dir / TEXT_GGUF), ModelShape.from_path(folder)
    assert from_gguf.vision is not None and from_gguf.vision == from_folder.vision
    assert from_gguf.vision == replace_pixels(vision_shape(models[0].vision), from_gguf.vision.max_pixels)
    config = EngineConfig(max_context=512, max_concurrency=1)
    keys = ("vision", "vision_activations", "encoder_cache")
    gguf_lines, folder_lines = ([build_ledger(shape, config, vram_mib=0, ram_mib=16_000).line(k).bytes for k in keys]
                                for shape in (from_gguf, from_folder))
    assert gguf_lines == folder_lines and all(gguf_lines)
    alone = tmp_path / TEXT_GGUF
    shutil.copy(gguf_dir / TEXT_GGUF, alone)
    assert ModelShape.from_path(alone).vision is None


def replace_pixels(shape, max_pixels: int):
    """A loaded tower's shape at the file's own pixel bound (the loaded one is capped by --max-image-pixels)."""
    from dataclasses import replace

    return replace(shape, max_pixels=max_pixels)
