"""``ninfer-eval needle``: pass-key retrieval over a grid of context lengths x depths, several seeds each.

A prompt of about L tokens repeats a filler passage; at depth d (0 = the start, 1 = the end) it hides "The pass key
is NNNNN. Remember it. NNNNN is the pass key." and ends with "What is the pass key? The pass key is". The item
passes when the greedy continuation (raw completion, no chat template) contains the key. Each seed draws another
key. A configuration that cannot attend to the middle of a long prompt (a KV window without retrieval) fails the
middle depths; one that sees everything passes wherever the model itself can retrieve.

With --keys K (multi-key), K doors each get a pass key ("One pass key for the red door is NNNNN.") and the question
asks for one door's; with --values V (multi-value) the asked door has V keys and the answer must hold all of them.
The asked door's first key sits at the cell's depth, the other sentences at seeded random depths."""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.tools.eval.results import ResultsFile, config_key

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about it.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
DOORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple", "silver", "golden", "brown", "grey")
MULTI_NEEDLE = "One pass key for the {door} door is {key}. "
MULTI_QUESTION = "\n\nWhat is the pass key for the {door} door? The pass key for the {door} door is"
MULTI_VALUES_QUESTION = "\n\nWhat are all the pass keys for the {door} door? The pass keys for the {door} door are"


def float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not numbers separated by commas (e.g. 0,0.5,1)") from None


def int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not whole numbers separated by commas (e.g. 512,1024)") \
            from None


def add_arguments(p) -> None:
    p.add_argument("--lengths", type=int_list, default=[512, 1024, 2048], metavar="L1,L2,...",
                   help="prompt lengths in tokens (default 512,1024,2048)")
    p.add_argument("--depths", type=float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0], metavar="D1,D2,...",
                   help="where the needle sits, 0 = start of the filler, 1 = its end (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--seeds", type=int, default=3, help="prompts (pass keys) per cell (default 3)")
    p.add_argument("--keys", type=int, default=1, help="doors with pass keys in each prompt; the question asks for "
                   "one door's, the others are distractors (multi-key; default 1: the single pass key)")
    p.add_argument("--values", type=int, default=1, help="pass keys of the asked door, all wanted in the answer "
                   "(multi-value; default 1)")
    p.add_argument("--png", type=Path, default=None, metavar="FILE.png",
                   help="write the heatmap here (default: next to --results, with .png; none without --results)")


def build_prompt(length: int, depth: float, key: int, count_tokens) -> str:
    """About ``length`` tokens (by ``count_tokens``) with the needle after ``depth`` of the filler sentences."""
    sentences = [s + "." for s in FILLER.strip().rstrip(".").split(". ")]
    fixed = count_tokens(INTRO + NEEDLE.format(key=key) + QUESTION)
    per = count_tokens(FILLER) / len(sentences)
    n = max(1, round((length - fixed) / per))
    filler = [sentences[i % len(sentences)] for i in range(n)]
    at = round(depth * n)
    return (INTRO + " ".join(filler[:at]) + (" " if at else "") + NEEDLE.format(key=key)
            + " ".join(filler[at:]) + QUESTION)


def hide(length: int, needles: list[tuple[float, str]], question: str, count_tokens) -> str:
    """About ``length`` tokens of filler with each (depth, sentence) of ``needles`` after that share of the filler
    sentences, ending with ``question``."""
    sentences = [s + "." for s in FILLER.strip().rstrip(".").split(". ")]
    fixed = count_tokens(INTRO + "".join(t for _, t in needles) + question)
    per = count_tokens(FILLER) / len(sentences)
    n = max(1, round((length - fixed) / per))
    filler = [sentences[i % len(sentences)] for i in range(n)]
    at: dict[int, list[str]] = {}
    for depth, text in needles:
        at.setdefault(round(depth * n), []).append(text)
    parts = []
    for i in range(n + 1):
        parts += [t.strip() for t in at.get(i, [])]
        if i < n:
            parts.append(filler[i])
    return INTRO + " ".join(parts) + question


def build_multi(length: int, depth: float, seed: int, count_tokens, keys: int, values: int) -> tuple[str, list[str]]:
    """A multi-key / multi-value prompt and the values the answer must hold. ``keys`` doors each have pass keys;
    the asked door's first key sits at ``depth``, everything else at seeded random depths. With ``values`` > 1 the
    asked door has that many keys and the answer must give all of them (multi-value); the other doors' keys are
    distractors (multi-key)."""
    rng = random.Random(f"needle-multi-{seed}-{length}-{depth}-{keys}-{values}")
    doors = rng.sample(DOORS, keys)
    secrets = rng.sample(range(10000, 100000), keys - 1 + values)
    asked, asked_keys = doors[0], [str(v) for v in secrets[:values]]
    needles = [(depth, MULTI_NEEDLE.format(door=asked, key=asked_keys[0]))]
    needles += [(rng.random(), MULTI_NEEDLE.format(door=asked, key=k)) for k in asked_keys[1:]]
    needles += [(rng.random(), MULTI_NEEDLE.format(door=d, key=secrets[values + i])) for i, d in enumerate(doors[1:])]
    question = (MULTI_QUESTION if values == 1 else MULTI_VALUES_QUESTION).format(door=asked)
    return hide(length, needles, question, count_tokens), asked_keys


def pass_key(length: int, depth: float, seed: int) -> int:
    return random.Random(f"needle-{seed}-{length}-{depth}").randint(10000, 99999)


def run(settings: Any, args, results_path: Path | None, progress) -> dict[str, Any]:
    from engine.tools.eval.target import ENGINE_KEYS, open_target

    if args.seeds < 1 or not args.lengths or not args.depths or any(not 0 <= d <= 1 for d in args.depths) \
            or any(n < 64 for n in args.lengths):
        raise NInferError("The needle grid needs --seeds >= 1, lengths of at least 64 tokens and depths from 0 to 1.",
                          "Fix --lengths, --depths or --seeds (e.g. --lengths 512,1024 --depths 0,0.5,1 --seeds 3).")
    where = {"url": args.url, "model": settings.model_id} if args.url \
        else {k: getattr(settings, k) for k in ENGINE_KEYS}
    if not 1 <= args.keys <= len(DOORS) or not 1 <= args.values <= 8:
        raise NInferError(f"--keys must be 1 to {len(DOORS)} and --values 1 to 8.", "E.g. --keys 4 or --values 3.")
    multi = args.keys > 1 or args.values > 1
    parts = [INTRO, FILLER, NEEDLE, QUESTION] if not multi else \
        [INTRO, FILLER, MULTI_NEEDLE, MULTI_QUESTION, MULTI_VALUES_QUESTION, args.keys, args.values]
    key = config_key({"target": where, "prompt": parts})
    results = ResultsFile(results_path, "needle", key)
    items = [(n, d, s) for n in args.lengths for d in args.depths for s in range(args.seeds)]
    todo = [it for it in items if _id(*it) not in results.done]
    info: dict[str, Any] = {"key": key, "lengths": args.lengths, "depths": args.depths, "seeds": args.seeds,
                            "keys": args.keys, "values": args.values,
                            "resumed": len(items) - len(todo), "target": None}
    if todo:
        target, count = open_target(args, settings, max(args.lengths))
        try:
            info["target"] = target.describe()
            for n, d, s in progress(todo, desc="needle", unit="prompt"):
                if multi:
                    prompt, wanted = build_multi(n, d, s, count, args.keys, args.values)
                else:
                    wanted = [str(pass_key(n, d, s))]
                    prompt = build_prompt(n, d, int(wanted[0]), count)
                answer = target.complete(prompt, 12 if len(wanted) == 1 else 8 * len(wanted))
                results.add(_id(n, d, s), {"length": n, "depth": d, "seed": s, "tokens": count(prompt),
                                           "passed": all(w in answer for w in wanted), "answer": answer[:160]})
        finally:
            target.close()
    rows = [results.done[_id(*it)] for it in items]
    grid = {(n, d): [r["passed"] for r in rows if r["length"] == n and r["depth"] == d]
            for n in args.lengths for d in args.depths}
    summary = {**info, "passed": sum(r["passed"] for r in rows), "items": len(rows),
               "cells": [{"length": n, "depth": d, "passed": sum(v), "total": len(v)} for (n, d), v in grid.items()]}
    png = args.png or (Path(results_path).with_suffix(".png") if results_path else None)
    if png:
        from engine.tools.eval.heatmap import write_heatmap

        write_heatmap(png, args.lengths, args.depths, {c: sum(v) / len(v) for c, v in grid.items()})
        summary["png"] = str(png)
    return summary


def _id(length: int, depth: float, seed: int) -> str:
    return f"L{length}-d{depth:g}-s{seed}"


def format_table(summary: dict[str, Any], command: str) -> str:
    lengths, depths = summary["lengths"], summary["depths"]
    cells = {(c["length"], c["depth"]): c for c in summary["cells"]}
    lines = [f"ninfer-eval needle: {command}"]
    if summary["target"]:
        lines.append("  target: " + ", ".join(f"{k} {v}" for k, v in summary["target"].items()))
    if summary.get("keys", 1) > 1 or summary.get("values", 1) > 1:
        lines.append(f"  {summary['keys']} door(s) a prompt, {summary['values']} key(s) of the asked door wanted")
    lines += [f"  passed {summary['passed']} of {summary['items']} prompts"
              + (f" ({summary['resumed']} from the results file)" if summary["resumed"] else "")
              + (f"; heatmap: {summary['png']}" if summary.get("png") else ""), "",
              "| depth \\ tokens | " + " | ".join(str(n) for n in lengths) + " |",
              "|---" * (len(lengths) + 1) + "|"]
    for d in depths:
        lines.append(f"| {d:g} | " + " | ".join(f"{cells[(n, d)]['passed']}/{cells[(n, d)]['total']}"
                                                for n in lengths) + " |")
    return "\n".join(lines)
