"""A transformers Qwen3.5 VL model (Qwen3_5ForConditionalGeneration) as llama.cpp's converter writes it: the text
model as a qwen35 GGUF (tests/engine/test_qwen35_formats.write_qwen35_gguf, with a vocabulary holding the vision
tokens) and the vision tower as a separate mmproj GGUF (conversion/qwen3vl.py Qwen3VLVisionModel over
conversion/base.py MmprojModel): architecture clip, projector qwen3vl_merger, the Conv3d patch embedding split into
its two temporal slices, the merger as v.post_ln / mm.0 / mm.2, the blocks under the gguf package's MMPROJ names;
F32, or F16 as the converter's --outtype f16 (matrices and the patch slices F16, norms and biases F32)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.engine.test_qwen35_formats import write_qwen35_gguf
from tests.engine.vision_models import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START

VISION_TOKENS = {IMAGE_TOKEN: "<|image_pad|>", VIDEO_TOKEN: "<|video_pad|>", VISION_START: "<|vision_start|>",
                 VISION_END: "<|vision_end|>"}
LANGUAGE, VISUAL = "model.language_model.", "model.visual."


def _vocabulary(size: int):
    """The converter's set_vocab, reduced: a gpt2 vocabulary whose words do not matter, the vision tokens CONTROL."""
    import gguf

    def add(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([VISION_TOKENS.get(i, f"t{i}") for i in range(size)])
        w.add_token_scores([0.0] * size)  # no merges: transformers' GGUF reader derives them from the scores
        w.add_token_types([gguf.TokenType.CONTROL if i in VISION_TOKENS else gguf.TokenType.NORMAL
                           for i in range(size)])
    return add


def write_text_gguf(hf, path: Path) -> Path:
    """The language model of `hf` as a qwen35 GGUF (F32), its vocabulary holding <|image_pad|> at IMAGE_TOKEN."""
    cfg = hf.config.text_config
    state = {("model." + n.removeprefix(LANGUAGE)) if n.startswith(LANGUAGE) else n: t
             for n, t in hf.state_dict().items() if not n.startswith(VISUAL)}
    return write_qwen35_gguf(state, cfg, path, metadata=_vocabulary(cfg.vocab_size))


def mmproj_tensors(hf) -> dict[str, np.ndarray]:
    """The tower's tensors under llama.cpp's mmproj names, as the converter's modify_tensors yields them."""
    import gguf

    vision = hf.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    merger = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
    out = {}
    for name, t in hf.state_dict().items():
        if not name.startswith(VISUAL):
            continue
        name, arr = name.replace(VISUAL, "visual.", 1), t.detach().float().numpy()
        if name == "visual.patch_embed.proj.weight":  # Conv3d [C, 3, 2, P, P] -> two Conv2d along time
            out["v.patch_embd.weight"], out["v.patch_embd.weight.1"] = arr[:, :, 0], arr[:, :, 1]
        elif name.startswith("visual.merger."):
            part, suffix = name.removeprefix("visual.merger.").split(".", 1)
            out[f"{merger[part]}.{suffix}"] = arr
        else:
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert mapped is not None, name
            out[mapped] = arr
    return out


def write_mmproj(hf, path: Path, *, f16: bool = False, projector: str = "qwen3vl_merger",
                 projection_dim: int | None = None, skip: tuple[str, ...] = (), mean=(0.5,) * 3,
                 std=(0.5,) * 3, pixels: tuple[int, int] | None = None, block_count: int | None = None) -> Path:
    """The vision tower of `hf` as an mmproj GGUF; `projector` / `projection_dim` claim another projector or text
    width, `block_count` another depth, `skip` leaves tensors out (the refusals' files); `pixels`: (min, max) written as
    clip.vision.image_min_pixels / image_max_pixels (keys the converter writes for other projectors, not this one)."""
    import gguf

    vision, text = hf.config.vision_config, hf.config.text_config
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(projection_dim or text.hidden_size)
    w.add_vision_image_size(int(vision.num_position_embeddings ** 0.5 * vision.patch_size))
    w.add_vision_patch_size(vision.patch_size)
    w.add_vision_embedding_length(vision.hidden_size)
    w.add_vision_feed_forward_length(vision.intermediate_size)
    w.add_vision_block_count(block_count or vision.depth)
    w.add_vision_head_count(vision.num_heads)
    w.add_vision_image_mean(list(mean))
    w.add_vision_image_std(list(std))
    w.add_clip_projector_type(projector)
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(vision.spatial_merge_size)
    w.add_vision_attention_layernorm_eps(text.rms_norm_eps)
    w.add_vision_is_deepstack_layers([False] * vision.depth)
    if pixels is not None:
        w.add_vision_min_pixels(pixels[0])
        w.add_vision_max_pixels(pixels[1])
    for name, arr in mmproj_tensors(hf).items():
        if name in skip:
            continue
        half = f16 and arr.ndim >= 2
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16 if half else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@torch.no_grad()
def round_vision_to_f16(hf) -> None:
    """The tower's matrices as an F16 mmproj file holds them: the oracle twin of write_mmproj(f16=True)."""
    for name, p in hf.named_parameters():
        if name.startswith(VISUAL) and p.dim() >= 2:
            p.copy_(p.half().float())
