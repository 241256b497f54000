"""How far --gdn-state-fp16 drifts from the fp32 state on long prompts: for each prompt length, the largest
difference in the logprobs of the first answer token's top 20 candidates, and how many greedy tokens agree.

    python scripts/gdn_state_drift.py PATH/TO/QWEN3.5-FOLDER --lengths 1024 8192 32768 --gen 32

The prompt is random token ids (seeded); a Gated-DeltaNet hybrid (Qwen3_5ForCausalLM folder) is required."""
from __future__ import annotations

import argparse

import numpy as np
import torch

from engine.build import build_engine
from engine.sampling import SamplingParams


def run(folder: str, prompt: list[int], gen: int, fp16: bool) -> tuple[torch.Tensor, list[int]]:
    loaded = build_engine(folder, device="cpu", max_context=len(prompt) + gen + 1, max_concurrency=1,
                          max_shared_prefixes=0, gdn_state_fp16=fp16, weight_dtype="fp32")
    try:
        vocab = loaded.config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, logprobs=min(20, vocab))
        outs = list(loaded.engine.start().submit(prompt, params))
        first = outs[0].logprobs[0]
        top = torch.full((vocab,), float("nan"))
        for token, logprob in first.top:
            top[token] = logprob
        return top, [t for o in outs for t in o.token_ids]
    finally:
        loaded.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    print("| prompt tokens | max logprob error of the first answer token's top 20 | greedy tokens agreeing |")
    print("|---|---|---|")
    for n in args.lengths:
        rng = np.random.default_rng(args.seed)
        prompt = [int(t) for t in rng.integers(2, 1000, n)]
        ref, ref_tokens = run(args.model, prompt, args.gen, False)
        got, got_tokens = run(args.model, prompt, args.gen, True)
        both = ~ref.isnan() & ~got.isnan()
        err = float((ref[both] - got[both]).abs().max()) if both.any() else float("nan")
        agree = next((i for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)) if a != b), len(ref_tokens))
        finite = bool(torch.isfinite(got[~got.isnan()]).all())
        print(f"| {n:,} | {err:.2e}{'' if finite else ' (non-finite!)'} | {agree} of {args.gen} |", flush=True)


if __name__ == "__main__":
    main()
