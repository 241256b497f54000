"""``ninfer-eval compare A B``: chosen checks on two configurations, side by side, in one report.

A and B are each one quoted argument of settings as ``ninfer-serve`` takes them, or ``--url URL`` for a server
('' is the defaults). Every check named by --check (a check and its options, quoted, e.g. --check 'needle --lengths
512,1024 --seeds 3') runs on both, with its items written to one resumable results file. The report (report.md,
report.json and the needle heatmaps as PNG, in --out) gives per check each side's counts with Wilson 95% intervals,
B minus A with its interval, and how many items got the very same answer on both sides (a speculative-decoding
setting must give 100%: greedy output does not change); for kld, each side's numbers against the reference."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.tools.eval import options
from engine.tools.eval.stats import difference, rate_text

ANSWER_FIELDS = {"needle": "answer", "count": "answer", "code": "completion", "agent": "answer"}
DEFAULT_CHECKS = ["needle --lengths 512,1024 --depths 0,0.5,1 --seeds 2", "code"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise NInferError(f"ninfer-eval compare: {message}.", "Run ninfer-eval compare --help for the options.")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ninfer-eval compare", allow_abbrev=False, description=(
        "Run checks on two configurations and report them side by side: ninfer-eval compare 'A FLAGS' 'B FLAGS' "
        "[--check 'CHECK OPTIONS' ...] [--out DIR]. A and B are ninfer-serve settings (or --url URL), one quoted "
        "argument each; '' means the defaults."))
    p.add_argument("--check", action="append", default=None, metavar="'CHECK OPTIONS'",
                   help="a check and its options, quoted; repeat for more (default: "
                        + " and ".join(repr(c) for c in DEFAULT_CHECKS) + ")")
    p.add_argument("--out", type=Path, default=Path("eval-compare"), help="folder of the report, its figures and "
                   "the resumable results file (default eval-compare)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on the terminal")
    return p


def main(argv: list[str]) -> int:
    """``argv`` after 'compare': A, B, then the options."""
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        opts = build_parser().parse_args(argv[2:])
        report = compare(argv[0], argv[1], opts.check or DEFAULT_CHECKS, opts.out,
                         options.progress_bar(not opts.no_progress))
    except NInferError as e:
        print(f"{e}", file=sys.stderr)
        return 1
    print(report)
    return 0


def compare(a: str, b: str, checks: list[str], out: Path, progress) -> str:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NInferError(f"Cannot create the report folder {out}: {e}.", "Give --out a writable folder.") from None
    results = out / "results.jsonl"
    report: dict[str, Any] = {"a": a, "b": b, "checks": {}}
    plan = []  # every check and side parsed before anything runs: a typo in B must not cost A's run
    for spec in checks:
        words = shlex.split(spec)
        if not words or words[0] not in options.CHECKS:
            raise NInferError(f"--check {spec!r} does not start with a check name.",
                              f"Start it with one of {', '.join(options.CHECKS)}, e.g. --check 'needle --seeds 2'.")
        sides = {}
        for side, flags in (("a", a), ("b", b)):
            extra = ["--png", str(out / f"{words[0]}-{side}.png")] if words[0] == "needle" else []
            try:
                sides[side] = options.parse([words[0], *words[1:], *shlex.split(flags), *extra])
            except NInferError as e:
                raise NInferError(f"Configuration {side.upper()} ({flags!r}) with --check {spec!r}: {e.problem}",
                                  e.remedy) from None
        plan.append((words[0], sides))
    for name, sides in plan:
        summaries = {}
        for side, (args, settings) in sides.items():
            print(f"ninfer-eval compare: {name} on {side.upper()}", file=sys.stderr)
            summaries[side] = options.CHECKS[name].run(settings, args, results, progress)
        report["checks"][name] = _side_by_side(name, summaries, results)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (out / "report.md").write_text(text)
    return text


def _side_by_side(name: str, sides: dict[str, dict], results: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"a": sides["a"], "b": sides["b"]}
    if name == "kld":
        return entry
    sa, sb = sides["a"], sides["b"]
    entry["difference"] = difference(sa["passed"], sa["items"], sb["passed"], sb["items"])
    field = ANSWER_FIELDS[name]
    rows: dict[str, dict[str, dict]] = {"a": {}, "b": {}}
    for line in results.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        for side in ("a", "b"):
            if row.get("check") == name and row.get("key") == sides[side]["key"]:
                rows[side][row["id"]] = row
    shared = sorted(set(rows["a"]) & set(rows["b"]))
    entry["identical"] = sum(rows["a"][i].get(field) == rows["b"][i].get(field) for i in shared)
    entry["compared"] = len(shared)
    return entry


def markdown(report: dict[str, Any]) -> str:
    lines = ["# ninfer-eval compare", "", f"- **A**: `{report['a'] or '(defaults)'}`",
             f"- **B**: `{report['b'] or '(defaults)'}`", ""]
    for name, e in report["checks"].items():
        a, b = e["a"], e["b"]
        lines += [f"## {name}", "", "| | A | B |", "|---|---|---|"]
        if name == "kld":
            for key, label, fmt in (("kld_mean", "KLD mean", "{:.6f}"), ("kld_p99", "KLD p99", "{:.6f}"),
                                    ("kld_p999", "KLD p99.9", "{:.6f}"), ("top1_agreement", "top-1 agreement",
                                                                          "{:.2%}"), ("ppl", "PPL", "{:.4f}")):
                lines.append(f"| {label} | {fmt.format(a[key])} | {fmt.format(b[key])} |")
            lines.append("")
            continue
        d, lo, hi = e["difference"]
        lines += [f"| passed | {rate_text(a['passed'], a['items'])} | {rate_text(b['passed'], b['items'])} |",
                  "", f"B − A: {100 * d:+.1f} points (95% CI {100 * lo:+.1f} to {100 * hi:+.1f}). "
                  f"Identical answers: {e['identical']} of {e['compared']}.", ""]
        if name == "needle":
            lines += [f"![needle, A]({Path(a['png']).name}) ![needle, B]({Path(b['png']).name})", ""]
    return "\n".join(lines)
