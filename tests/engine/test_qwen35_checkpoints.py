"""Qwen3.5 checkpoints as they are published: Qwen3_5ForConditionalGeneration folders, whose config.json nests the
text model's fields under text_config (mrope and the rotated share inside rope_parameters) and whose weights hold the
text model under model.language_model., a vision tower under model.visual. and the MTP layer under mtp.; against
transformers on a tiny random checkpoint (fp32; perturbed norms, A_log and dt_bias; 4 value heads over 2 key heads;
3 GDN : 1 attention layers). Their mixture-of-experts variant: tests/engine/test_qwen35_moe.py."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from engine.errors import ModelLoadError
from engine.build import build_engine
from engine.model.hf_folder import load_folder, read_config
from engine.model.registry import build_model
from engine.sampling import SamplingParams
from tests.engine.helpers import add_tokenizer, rel_err
from tests.engine.qwen35_models import perturb
from tests.engine.test_qwen35_formats import mtp_tensors, prefill_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 256
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=4096,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
# what the published Qwen3.5 config.json adds to transformers' own text_config (Qwen3.5-27B: mrope_section
# [11, 11, 10] over its 32 rotated pairs; here [2, 1, 1] over 4)
PUBLISHED_TEXT = dict(full_attention_interval=4, attn_output_gate=True, mamba_ssm_dtype="float32",
                      mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
PUBLISHED_ROPE = dict(mrope_section=[2, 1, 1], mrope_interleaved=True)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny Qwen3_5ForConditionalGeneration saved by transformers, its config.json completed with the fields the
    published checkpoints carry, an MTP layer in a shard of its own, and the model transformers loads back from it."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    torch.manual_seed(0)
    built = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION)).eval()
    perturb(built, prefix="model.language_model.")
    folder = tmp_path_factory.mktemp("qwen35-published") / "tiny-qwen3.5"
    built.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["text_config"].update(PUBLISHED_TEXT)
    raw["text_config"]["rope_parameters"].update(PUBLISHED_ROPE)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    mtp = mtp_tensors(Qwen3_5TextConfig(**TEXT))
    save_file(mtp, str(folder / "model-mtp.safetensors"))
    add_tokenizer(folder, VOCAB)
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.text_config.rope_parameters["mrope_section"] == [2, 1, 1]
    return hf, folder, mtp


@pytest.fixture(scope="module")
def causal_lm(published):
    """transformers' Qwen3_5ForCausalLM over the same text weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf, _, _ = published
    lm = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT)).eval()
    state = {k.replace("model.language_model.", "model.", 1): v for k, v in hf.state_dict().items()
             if not k.startswith("model.visual.")}
    missing, unexpected = lm.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    return lm


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_the_config_is_read_from_text_config_as_transformers_reads_it(published):
    hf, folder, _ = published
    text = hf.config.text_config
    cfg = read_config(folder)
    assert cfg.arch == "qwen35" and cfg.num_layers == text.num_hidden_layers
    assert cfg.layer_kinds == tuple("attention" if t == "full_attention" else "recurrent" for t in text.layer_types)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == \
        (text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.intermediate_size)
    n = cfg.linear
    assert (n.num_k_heads, n.num_v_heads, n.head_k_dim, n.head_v_dim, n.conv_kernel) == \
        (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
         text.linear_value_head_dim, text.linear_conv_kernel_dim)
    assert cfg.partial_rotary == text.rope_parameters["partial_rotary_factor"] == 0.25
    assert cfg.rope_theta == text.rope_parameters["rope_theta"] and cfg.rope_scaling is None  # mrope: plain for text
    assert cfg.tie_embeddings is hf.config.tie_word_embeddings is False
    assert cfg.vocab_size == text.vocab_size and cfg.max_position == text.max_position_embeddings


def test_the_vision_tower_is_not_read_and_the_load_log_says_so(published, caplog):
    hf, folder, mtp = published
    with caplog.at_level(logging.INFO, logger="ninfer.model"):
        weights = load_folder(folder)
    vision = [n for n in hf.state_dict() if n.startswith("model.visual.")]
    assert vision and not any(n.startswith(("model.visual.", "model.language_model.")) for n in weights.tensors)
    assert sorted(n for n in weights.tensors if n.startswith("mtp.")) == sorted(mtp)
    [record] = [r for r in caplog.records if "vision tower" in r.getMessage()]
    assert f"{len(vision)} tensors under model.visual." in record.getMessage()
    assert "text only" in record.getMessage()


def test_logits_match_transformers_conditional_generation_and_causal_lm(published, causal_lm):
    """The engine on the published layout against transformers' Qwen3_5ForConditionalGeneration on text input and
    its Qwen3_5ForCausalLM on the same text weights (131 tokens: three 64-token chunks of the delta rule)."""
    hf, folder, _ = published
    model = build_model(load_folder(folder), torch.float32, torch.device("cpu"))
    tokens = ids(1, 131)
    ours, reference = prefill_logits(model, tokens), hf_logits(hf, tokens)
    assert rel_err(hf_logits(causal_lm, tokens), reference) <= 1e-5  # the two transformers classes agree
    assert rel_err(ours, reference) <= 1e-4


def test_the_engine_serves_it_as_transformers_generates(published, causal_lm):
    _, folder, _ = published
    loaded = build_engine(folder, device="cpu", max_context=512, max_concurrency=1)
    try:
        prompt = ids(2, 45)
        out = loaded.engine.start().generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        ref = causal_lm.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                                 eos_token_id=None, pad_token_id=0)
        assert out == ref[0, len(prompt):].tolist()
    finally:
        loaded.engine.shutdown()


def _config_only(tmp_path, raw: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_a_moe_family_the_engine_does_not_run_is_refused_naming_it(published, tmp_path):
    _, folder, _ = published
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    with pytest.raises(ModelLoadError) as e:
        read_config(_config_only(tmp_path, raw))
    assert "Qwen3MoeForCausalLM" in e.value.problem and "mixture-of-experts" in e.value.problem
    assert "Qwen3_5MoeForConditionalGeneration" in e.value.remedy


def test_a_conditional_generation_config_without_text_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        read_config(_config_only(tmp_path, {"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    assert "text_config" in e.value.problem and "Download" in e.value.remedy


def test_fields_left_out_take_transformers_defaults(tmp_path):
    """A minimal Qwen3.5 text config (no head_dim, no linear_* sizes, no rope_parameters, no layer_types): the
    values transformers' Qwen3_5TextConfig gives the same config.json (full_attention_interval 3 here)."""
    from transformers import Qwen3_5TextConfig

    minimal = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                   num_attention_heads=8, full_attention_interval=3)
    folder = _config_only(tmp_path, {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": minimal})
    (tmp_path / "text.json").write_text(json.dumps(minimal))
    text = Qwen3_5TextConfig.from_json_file(str(tmp_path / "text.json"))
    cfg = read_config(folder)
    assert cfg.layer_kinds == tuple("attention" if t == "full_attention" else "recurrent" for t in text.layer_types)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.max_position) == \
        (text.head_dim, text.num_key_value_heads, text.max_position_embeddings)
    n = cfg.linear
    assert (n.num_k_heads, n.num_v_heads, n.head_k_dim, n.head_v_dim, n.conv_kernel) == \
        (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
         text.linear_value_head_dim, text.linear_conv_kernel_dim)
    assert cfg.partial_rotary == text.rope_parameters["partial_rotary_factor"]
    assert cfg.rope_theta == text.rope_parameters["rope_theta"] and not cfg.tie_embeddings
