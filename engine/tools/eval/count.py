"""``ninfer-eval count``: the counting stress test. A prompt of about L tokens lists words; one word (the target)
occurs K times, spread evenly over the whole list, so that the right answer needs every part of the context. The
prompt ends with "How many times does the word "W" appear in the list above? The answer is"; the item passes when
the first number of the greedy continuation is K. A configuration that attends to only part of the prompt (a KV
window without retrieval, or retrieval too shallow) counts only what it sees and answers less. It asks more of the
model than a pass key: a small model may fail it with the full cache too (docs/EVAL.md)."""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.tools.eval.needle import int_list
from engine.tools.eval.results import ResultsFile, config_key

WORDS = ("stone", "river", "cloud", "table", "green", "paper", "window", "garden", "silver", "candle", "bridge",
         "orange", "pencil", "winter", "harbour", "button", "ladder", "forest", "mirror", "basket")
TARGETS = ("apple", "tiger", "violin", "rocket", "pepper")
INTRO = "Here is a list of words.\n\n"
QUESTION = "\n\nHow many times does the word \"{word}\" appear in the list above? The answer is"


def add_arguments(p) -> None:
    p.add_argument("--lengths", type=int_list, default=[512, 1024, 2048], metavar="L1,L2,...",
                   help="prompt lengths in tokens (default 512,1024,2048)")
    p.add_argument("--seeds", type=int, default=5, help="prompts per length, each with its own word and count "
                   "(default 5)")
    p.add_argument("--max-count", type=int, default=8, help="the most occurrences of the target (default 8; at "
                   "least 2, drawn from 2 to this)")


def build_prompt(length: int, seed: int, count_tokens, max_count: int = 8) -> tuple[str, str, int]:
    """(prompt, target word, occurrences): about ``length`` tokens, the occurrences evenly spread (one in each of
    ``occurrences`` equal parts of the list, at a random place within its part)."""
    rng = random.Random(f"count-{seed}-{length}")
    word, k = rng.choice(TARGETS), rng.randint(2, max(2, max_count))
    fixed = count_tokens(INTRO + QUESTION.format(word=word))
    per = count_tokens(", ".join(WORDS)) / len(WORDS)
    n = max(k * 4, round((length - fixed) / per))
    words = [rng.choice(WORDS) for _ in range(n)]
    part = n / k
    for i in range(k):
        words[int(i * part) + rng.randrange(max(1, int(part)))] = word
    return INTRO + ", ".join(words) + "." + QUESTION.format(word=word), word, k


def first_number(answer: str) -> int | None:
    words = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
             "one": 1, "zero": 0, "eleven": 11, "twelve": 12}
    m = re.search(r"\d+|\b(" + "|".join(words) + r")\b", answer.lower())
    if not m:
        return None
    return int(m.group(0)) if m.group(0).isdigit() else words[m.group(0)]


def run(settings: Any, args, results_path: Path | None, progress) -> dict[str, Any]:
    from engine.tools.eval.target import ENGINE_KEYS, open_target

    if args.seeds < 1 or not args.lengths or any(n < 64 for n in args.lengths) or args.max_count < 2:
        raise NInferError("The count check needs --seeds >= 1, lengths of at least 64 tokens and --max-count >= 2.",
                          "Fix --lengths, --seeds or --max-count (e.g. --lengths 512,1024 --seeds 5).")
    where = {"url": args.url, "model": settings.model_id} if args.url \
        else {k: getattr(settings, k) for k in ENGINE_KEYS}
    key = config_key({"target": where, "prompt": [INTRO, QUESTION, WORDS, TARGETS], "max_count": args.max_count})
    results = ResultsFile(results_path, "count", key)
    items = [(n, s) for n in args.lengths for s in range(args.seeds)]
    todo = [it for it in items if _id(*it) not in results.done]
    info: dict[str, Any] = {"key": key, "lengths": args.lengths, "seeds": args.seeds,
                            "resumed": len(items) - len(todo), "target": None}
    if todo:
        target, count = open_target(args, settings, max(args.lengths))
        try:
            info["target"] = target.describe()
            for n, s in progress(todo, desc="count", unit="prompt"):
                prompt, word, k = build_prompt(n, s, count, args.max_count)
                answer = target.complete(prompt, 8)
                got = first_number(answer)
                results.add(_id(n, s), {"length": n, "seed": s, "tokens": count(prompt), "word": word,
                                        "expected": k, "answered": got, "passed": got == k, "answer": answer[:80]})
        finally:
            target.close()
    rows = [results.done[_id(*it)] for it in items]
    per = []
    for n in args.lengths:
        mine = [r for r in rows if r["length"] == n]
        under = sum(1 for r in mine if r["answered"] is not None and r["answered"] < r["expected"])
        per.append({"length": n, "passed": sum(r["passed"] for r in mine), "total": len(mine), "under": under,
                    "no_number": sum(1 for r in mine if r["answered"] is None)})
    return {**info, "passed": sum(r["passed"] for r in rows), "items": len(rows), "by_length": per}


def _id(length: int, seed: int) -> str:
    return f"L{length}-s{seed}"


def format_table(summary: dict[str, Any], command: str) -> str:
    lines = [f"ninfer-eval count: {command}"]
    if summary["target"]:
        lines.append("  target: " + ", ".join(f"{k} {v}" for k, v in summary["target"].items()))
    lines += [f"  passed {summary['passed']} of {summary['items']} prompts"
              + (f" ({summary['resumed']} from the results file)" if summary["resumed"] else ""), "",
              "| tokens | passed | answered too few | no number |", "|---|---|---|---|"]
    lines += [f"| {r['length']} | {r['passed']}/{r['total']} | {r['under']} | {r['no_number']} |"
              for r in summary["by_length"]]
    return "\n".join(lines)
