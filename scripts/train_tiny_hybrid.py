"""Trains a small Qwen3.5-class Gated-DeltaNet hybrid (3 GDN : 1 gated attention) on text, on the CPU, for a
checkpoint whose recurrent states carry what a trained model's do (a random model's stay small and shapeless): the
model `scripts/gdn_state_drift.py` measures --gdn-state-fp16 on.

    python scripts/train_tiny_hybrid.py OUT_FOLDER --minutes 15

The text defaults to this Python's standard library sources (present wherever Python is; no download); the
tokenizer is the default model's (SmolLM2, embedded). transformers' Qwen3_5ForCausalLM computes the training
steps (it is the oracle the engine is tested against); the saved folder loads in `ninfer-serve` and `build_engine`.
"""
from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch


def corpus(paths: list[Path], tokenizer, limit: int) -> torch.Tensor:
    """Token ids of the files under `paths` (.py files of folders), concatenated, at most `limit`."""
    ids: list[int] = []
    files = sorted(p for root in paths for p in ([root] if root.is_file() else root.rglob("*.py")))
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids += tokenizer.encode(text) + [tokenizer.eos_token_id or 0]
        if len(ids) >= limit:
            break
    return torch.tensor(ids[:limit])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--text", type=Path, nargs="*", default=None, help="files or folders of .py files "
                    "(default: the standard library)")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps too (0: no limit)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.layers % 4:
        raise SystemExit("--layers must be a multiple of 4 (3 GDN layers and 1 attention layer, repeated)")
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from engine.model.default import default_model_path

    torch.manual_seed(args.seed)
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    data = corpus(args.text or [Path(sysconfig.get_paths()["stdlib"])], tokenizer, 4_000_000)
    h = args.hidden
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=h, intermediate_size=3 * h, num_hidden_layers=args.layers,
        num_attention_heads=h // 64, num_key_value_heads=max(1, h // 128), head_dim=64, linear_num_key_heads=h // 128,
        linear_num_value_heads=h // 64, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        max_position_embeddings=65536, tie_word_embeddings=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    model = Qwen3_5ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {data.numel():,} tokens of text")
    start, step = time.time(), 0
    while step == 0 or (time.time() - start < args.minutes * 60 and step != args.steps):
        rows = torch.randint(0, data.numel() - args.seq - 1, (args.batch,))
        batch = torch.stack([data[r:r + args.seq] for r in rows.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step}  loss {loss.item():.3f}  {time.time() - start:.0f} s", flush=True)
    model.generation_config.eos_token_id = None
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.out} after {step} steps, loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
