"""Pass-key sweep for windowed prefix reuse on the embedded default model: does a windowed request that reuses
another prompt's prefix find the key the same request finds sent cold, and the full cache finds?

    python scripts/needle_reuse_sweep.py --depths 0.2 0.5 --keys 71432 50917 --retrieve 512 1024 --filler 150

The full sweep of the windowed-reuse issue (9 depths, 4 keys, the weights as ninfer-serve runs them), resumable:

    python scripts/needle_reuse_sweep.py --depths 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 \
        --keys 71432 50917 28461 93105 --out sweep.md

For each depth d and key k the prompt is a filler text with the key sentence at depth d and a question at the end.
It is sent (1) to the full cache, (2) cold to a windowed engine (--kv-window 512, no prefix reuse) and (3) to a
windowed engine with prefix reuse, right after a prompt with the same filler and another key at depth d - 0.3 (or
d + 0.3 where d - 0.3 < 0.1), which shares the filler up to the nearer key. One row per (retrieve, depth, key):
the greedy answers, whether each holds the key, and the tokens the warm request reused. With --out, rows are
appended to that file as they finish and rows already in it are skipped, so a stopped sweep resumes where it was."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.build import build_engine
from engine.engine import Engine
from engine.runner import ModelRunner
from engine.sampling import SamplingParams

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEAD = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def prompt_text(key: str, depth: float, filler: int) -> str:
    at = round(depth * filler)
    sentence = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return HEAD + FILLER * at + sentence + FILLER * (filler - at) + QUESTION


def answer(model, kv_dtype, prompts: list[list[int]], n: int, **kw) -> tuple[list[int], dict]:
    """Sends the prompts in turn to a fresh engine; the last one's greedy tokens and the engine's stats."""
    runner = ModelRunner(model, kw.pop("num_pages"), kv_dtype, 64, host_pages=kw.pop("host_pages", 0))
    engine = Engine(runner, max_concurrency=1, prefill_chunk=512, max_context=8192, **kw).start()
    try:
        for p in prompts[:-1]:
            engine.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        before = engine.stats()["prefix_hit_tokens"]
        out = engine.generate(prompts[-1], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        stats = engine.stats()
        stats["reused"] = stats["prefix_hit_tokens"] - before
        return out, stats
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.2, 0.5])
    ap.add_argument("--keys", nargs="+", default=["71432", "50917"])
    ap.add_argument("--retrieve", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--filler", type=int, default=150, help="filler sentences (150: ~3,700 tokens)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--weight-dtype", default="auto", help="as ninfer-serve's --weight-dtype (auto: what it runs)")
    ap.add_argument("--out", type=Path, default=None, help="append the rows to this Markdown file; skip rows in it")
    args = ap.parse_args()

    loaded = build_engine(None, max_concurrency=1, max_context=2048, weight_dtype=args.weight_dtype)
    model, tok, kv_dtype = loaded.engine.runner.model, loaded.tokenizer, loaded.engine.runner.kv.kv_dtype
    n = args.max_tokens
    header = ("| retrieve | depth | key | full cache | cold | warm (reused tokens) |\n"
              "| --- | --- | --- | --- | --- | --- |\n")
    done = args.out.read_text(encoding="utf-8") if args.out is not None and args.out.exists() else ""
    if args.out is not None and not done:
        args.out.write_text(header, encoding="utf-8")
    print(header, end="", flush=True)
    missed = differ = rows = 0
    for depth in args.depths:
        # the other key 0.3 earlier where that leaves it past the head (so the prompts share some filler), else later
        other_depth = round(depth - 0.3, 2) if depth - 0.3 >= 0.1 else round(depth + 0.3, 2)
        for key in args.keys:
            todo = [r for r in args.retrieve if f"| {r} | {depth} | {key} |" not in done]
            if not todo:
                continue
            ids = tok.encode(prompt_text(key, depth, args.filler))
            other = tok.encode(prompt_text(str(99999 - int(key)), other_depth, args.filler))
            pages = -(-(len(ids) + n) // 64) + 1
            full, _ = answer(model, kv_dtype, [ids], n, num_pages=pages, max_shared_prefixes=0)
            for retrieve in todo:
                t0 = time.monotonic()
                win = dict(kv_window=512, kv_retrieve=retrieve, num_pages=48, host_pages=2 * pages)
                cold, _ = answer(model, kv_dtype, [ids], n, max_shared_prefixes=0, **win)
                warm, stats = answer(model, kv_dtype, [other, ids], n, max_shared_prefixes=4, **win)
                found = [key in tok.decode(out) for out in (full, cold, warm)]
                cells = [f"{'found' if hit else 'MISSED'}: {tok.decode(out).strip()!r}"
                         for hit, out in zip(found, (full, cold, warm))]
                rows += 1
                missed += found[1] and not found[2]
                differ += cold != warm
                line = (f"| {retrieve} | {depth} | {key} | {cells[0]} | {cells[1]} | {cells[2]} ({stats['reused']}) |"
                        f"  <!-- {len(ids)} tokens, {time.monotonic() - t0:.0f} s -->\n")
                print(line, end="", flush=True)
                if args.out is not None:
                    with args.out.open("a", encoding="utf-8") as f:
                        f.write(line)
    print(f"{rows} rows run; warm requests that missed a key the cold request found: {missed}; warm answers that "
          f"differ from the cold ones: {differ}")


if __name__ == "__main__":
    main()
