"""Tiny random Qwen3.5-class hybrids for the tests (transformers' models are the oracle): the 8-layer checkpoint
most tests share (3 GDN : 1 gated attention, value heads > key heads) and the perturbation that makes norms, A_log
and dt_bias non-trivial."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.helpers import add_tokenizer

VOCAB = 256
PERTURBED = ("norm.weight", "A_log", "dt_bias")


def tiny_config(**overrides):
    """8 layers (3 GDN + 1 attention, twice), hidden 64, 4 query / 2 KV heads x 32, GDN 2 key / 4 value heads x 16."""
    from transformers import Qwen3_5TextConfig

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    return Qwen3_5TextConfig(**{**fields, **overrides})


@torch.no_grad()
def perturb(model, prefix: str = "", scale: float = 0.3) -> None:
    """Adds scale x N(0, 1) to every norm weight, A_log and dt_bias under `prefix` (transformers initialises them
    to values that would hide mistakes: zero-centred norms at 0, A_log and dt_bias alike across heads)."""
    for name, p in model.named_parameters():
        if name.startswith(prefix) and name.endswith(PERTURBED):
            p.add_(scale * torch.randn_like(p))


def save_for_engine(hf, folder: Path, vocab: int = VOCAB) -> Path:
    """Saves a transformers model where build_engine can load it (with a word-level tokenizer), generation with no
    end-of-sequence token."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    hf.save_pretrained(folder)
    add_tokenizer(folder, vocab)
    return folder


def tiny_checkpoint(folder: Path, seed: int = 0, **overrides):
    """A seeded, perturbed transformers Qwen3_5ForCausalLM of tiny_config(**overrides), saved where build_engine
    loads it: (the transformers model, the folder)."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3_5ForCausalLM(tiny_config(**overrides)).eval()
    perturb(hf)
    return hf, save_for_engine(hf, folder)
