"""HF transformers as a peer for ``ninfer-bench`` (the default ``--compare transformers``): the same model, dtype,
device, thread count and prompt token ids, greedy, never stopping early, in this process."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from engine.tools.bench.measure import decode_bytes_per_token, summarise


def load_transformers(path: Path, dtype: torch.dtype, device: torch.device):
    """The same model in HF transformers: a GGUF (dequantized to dtype) or an HF folder."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported: set it before transformers
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    path = Path(path)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


def bench_transformers(model, prompt_ids: list[int], gen_tokens: int, repeat: int = 3) -> dict:
    """HF generate, greedy, batch 1. TTFT = generate(max_new_tokens=1); decode tok/s =
    (N-1) / (t(generate N) - TTFT)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    mask = torch.ones_like(ids)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (model.generation_config.eos_token_id or 0)
    pad = pad[0] if isinstance(pad, list) else pad

    def timed(n: int) -> tuple[float, list[int]]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, out[0, len(prompt_ids):].tolist()

    runs = []
    for i in range(repeat + 1):
        t_first, _ = timed(1)
        t_all, tokens = timed(gen_tokens)
        if i:
            runs.append(dict(ttft_s=t_first, decode_s=max(t_all - t_first, 1e-9), tokens=tokens))
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    elem = next(model.parameters()).element_size()
    # Read per token, as LlamaModel.weight_bytes counts: every parameter (tied ones once) except the input
    # embedding table, of which one row is read, unless it is also the output layer.
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        weights -= embed.numel() * embed.element_size()
    kv_per_pos = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem
    return dict(summarise(runs, len(prompt_ids), gen_tokens, decode_bytes_per_token(
        weights, kv_per_pos, len(prompt_ids), gen_tokens)), weight_bytes=weights)
