"""``ninfer-bench --spec METHOD``: decode speed with speculative decoding against the same engine without it, on
three kinds of content (the seeds' table: repetitive/structured, code, prose), with acceptance rates.

Both engines share the model weights and run batch 1, greedy, stopping at the model's end of turn; plain and
speculative runs alternate, and the median of --repeat runs (after a warm-up) is reported. Greedy speculation is
lossless, so both produce the same tokens: the table says so for each row."""
from __future__ import annotations

import statistics
import time

from engine.engine import Engine
from engine.runner import ModelRunner
from engine.sampling import SamplingParams

CONTENT = {
    "repetitive": 'Repeat this JSON exactly, changing only "age" to 31 and nothing else:\n'
                  '{"name": "Alice Martin", "age": 30, "email": "alice.martin@example.com", "city": "Paris", '
                  '"country": "France", "tags": ["admin", "editor", "viewer"], "active": true, "score": 87.5, '
                  '"address": {"street": "12 Rue de Rivoli", "zip": "75001"}}',
    "code": "Write a Python function that checks whether a string is a palindrome, ignoring case and "
            "punctuation, with a docstring and three example calls.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _measure(engine, prompt: list[int], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = engine.stats()
    stamps, tokens = [], []
    for out in engine.submit(list(prompt), params):
        if out.error:
            raise RuntimeError(out.error)
        now = time.perf_counter()
        stamps.extend([now] * len(out.token_ids))
        tokens.extend(out.token_ids)
    after = engine.stats()
    drafted = after.get("spec_drafted", 0) - before.get("spec_drafted", 0)
    accepted = after.get("spec_accepted", 0) - before.get("spec_accepted", 0)
    steps = after.get("spec_steps", 0) - before.get("spec_steps", 0)
    seconds = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
    return dict(tokens=tokens, decode_s=seconds, drafted=drafted, accepted=accepted, steps=steps)


def bench_content(plain, spec, prompt: list[int], max_tokens: int, repeat: int) -> dict:
    runs = {"none": [], "spec": []}
    for i in range(repeat + 1):
        for name, engine in (("none", plain), ("spec", spec)):
            r = _measure(engine, prompt, max_tokens)
            if i:
                runs[name].append(r)
    n = len(runs["spec"][-1]["tokens"])
    none_s = statistics.median(r["decode_s"] for r in runs["none"])
    spec_s = statistics.median(r["decode_s"] for r in runs["spec"])
    drafted = sum(r["drafted"] for r in runs["spec"])
    accepted = sum(r["accepted"] for r in runs["spec"])
    steps = sum(r["steps"] for r in runs["spec"])
    return dict(tokens=n, none_tps=(n - 1) / none_s, spec_tps=(n - 1) / spec_s, speedup=none_s / spec_s,
                acceptance=accepted / drafted if drafted else 0.0, mean_accepted=accepted / steps if steps else 0.0,
                drafted=drafted // repeat, identical=runs["none"][-1]["tokens"] == runs["spec"][-1]["tokens"],
                runs={k: [{x: y for x, y in r.items() if x != "tokens"} for r in v] for k, v in runs.items()})


def format_spec_table(method: str, results: dict) -> str:
    head = (f"| content    | tokens | none tok/s | {method} tok/s | speedup | acceptance | accepted/step | "
            f"same output |")
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for content, r in results.items():
        lines.append(f"| {content:<10} | {r['tokens']:>6} | {r['none_tps']:>10.2f} | {r['spec_tps']:>{len(method) + 6}.2f} "
                     f"| {r['speedup']:>6.2f}x | {r['acceptance']:>9.1%} | {r['mean_accepted']:>13.2f} | "
                     f"{'yes' if r['identical'] else 'NO':>11} |")
    return "\n".join(lines)


def run_spec_bench(args, loaded) -> dict:
    """loaded: build_engine(..., spec=args.spec); a plain engine over the same model is built beside it."""
    spec = loaded.engine
    runner = spec.runner
    plain = Engine(ModelRunner(runner.model, runner.pool.num_pages, runner.kv.kv_dtype, runner.page_size),
                   max_concurrency=1, prefill_chunk=512, max_context=loaded.context_window,
                   eos_ids=loaded.tokenizer.eos_token_ids, max_shared_prefixes=0).start()
    spec.start()
    try:
        results = {}
        for content, text in CONTENT.items():
            prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            results[content] = bench_content(plain, spec, prompt, args.gen_tokens, args.repeat)
        return results
    finally:
        plain.shutdown()
        spec.shutdown()
