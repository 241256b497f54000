"""How far --gdn-state-fp16 drifts from the fp32 state on long prompts: for each prompt length, the largest
difference in the logprobs of the first answer token's top 20 candidates, the same over every decode step while the
greedy tokens agree (each step stores the state in fp16 again), and how many greedy tokens agree.

    python scripts/gdn_state_drift.py PATH/TO/QWEN3.5-FOLDER --lengths 1024 8192 32768 --gen 32

The prompt is random token ids (seeded), or with `--text FILE_OR_FOLDER` real text (a folder's .py files, joined and
cut to each length) tokenized by the model's own tokenizer: what a trained model's state meets in use
(`scripts/train_tiny_hybrid.py` trains one on code). A Gated-DeltaNet hybrid (Qwen3_5ForCausalLM folder) is
required."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from engine.build import build_engine
from engine.sampling import SamplingParams


def run(folder: str, prompt: list[int], gen: int, fp16: bool) -> tuple[list[torch.Tensor], list[int]]:
    """Each generated token's top-20 logprobs (NaN elsewhere, [vocab] each) and the greedy tokens."""
    loaded = build_engine(folder, device="cpu", max_context=len(prompt) + gen + 1, max_concurrency=1,
                          max_shared_prefixes=0, gdn_state_fp16=fp16, weight_dtype="fp32")
    try:
        vocab = loaded.config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, logprobs=min(20, vocab))
        outs = list(loaded.engine.start().submit(prompt, params))
        tops = []
        for entry in (lp for o in outs for lp in o.logprobs):
            top = torch.full((vocab,), float("nan"))
            for token, logprob in entry.top:
                top[token] = logprob
            tops.append(top)
        return tops, [t for o in outs for t in o.token_ids]
    finally:
        loaded.engine.shutdown()


def error(ref: torch.Tensor, got: torch.Tensor) -> float:
    both = ~ref.isnan() & ~got.isnan()
    return float((ref[both] - got[both]).abs().max()) if both.any() else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", type=Path, default=None, help="a file or a folder of .py files: prompts of real text")
    args = ap.parse_args()
    text_ids = None
    if args.text is not None:
        from transformers import AutoTokenizer

        files = [args.text] if args.text.is_file() else sorted(args.text.rglob("*.py"))
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        text_ids = []
        for f in files:
            text_ids += tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
            if len(text_ids) >= max(args.lengths):
                break
        if len(text_ids) < max(args.lengths):
            raise SystemExit(f"--text {args.text} has {len(text_ids):,} tokens, fewer than {max(args.lengths):,}")
    torch.set_grad_enabled(False)
    print("| prompt tokens | max logprob error, first answer token's top 20 | the same over the decode steps | "
          "greedy tokens agreeing |")
    print("|---|---|---|---|")
    for n in args.lengths:
        rng = np.random.default_rng(args.seed)
        prompt = text_ids[:n] if text_ids is not None else [int(t) for t in rng.integers(2, 1000, n)]
        ref, ref_tokens = run(args.model, prompt, args.gen, False)
        got, got_tokens = run(args.model, prompt, args.gen, True)
        agree = next((i for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)) if a != b), len(ref_tokens))
        steps = max(error(a, b) for a, b in zip(ref[:agree + 1], got[:agree + 1]))  # same context up to there
        finite = all(bool(torch.isfinite(t[~t.isnan()]).all()) for t in got)
        print(f"| {n:,} | {error(ref[0], got[0]):.2e}{'' if finite else ' (non-finite!)'} | {steps:.2e} | "
              f"{agree} of {args.gen} |", flush=True)

if __name__ == "__main__":
    main()
