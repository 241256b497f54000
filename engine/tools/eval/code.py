"""``ninfer-eval code``: small programming problems, each a function signature with a docstring; the model's raw
continuation of the prompt is run with the problem's tests in the sandbox (sandbox.py).

Problems are HumanEval-format JSON lines (task_id, prompt, entry_point, test; the test defines
``check(candidate)``). The bundled set (resources/eval/code_problems.jsonl) is the project's own; --problems takes
any such file. The program run is the prompt, the continuation cut at the first line that starts a new top-level
statement, the test, and ``check(ENTRY_POINT)``, which is always appended: HumanEval's test field only defines
check, so without that call an empty body would pass. An item passes when the program exits with status 0."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.tools.eval.results import ResultsFile, config_key
from engine.tools.eval.sandbox import Limits, run_program
from engine.tools.eval.stats import rate_text, wilson

PROBLEMS = Path(__file__).resolve().parents[3] / "resources" / "eval" / "code_problems.jsonl"
# a continuation ends where a new top-level statement starts (HumanEval's stop sequences)
STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\nassert ", "\n@")
FIELDS = ("task_id", "prompt", "entry_point", "test")


def add_arguments(p) -> None:
    p.add_argument("--problems", type=Path, default=None, metavar="FILE.jsonl",
                   help="HumanEval-format problems (task_id, prompt, entry_point, test) instead of the bundled "
                        f"set ({PROBLEMS.name})")
    p.add_argument("--limit", type=int, default=0, help="run only the first N problems (0: all)")
    p.add_argument("--max-tokens", type=int, default=384, help="tokens of continuation per problem (default 384)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a program may run (default 10)")
    p.add_argument("--memory-mib", type=int, default=1024, help="address space a program may use (default 1024)")


def load_problems(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise NInferError(f"Cannot read the problems file {path}: {e}.", "Give --problems a UTF-8 JSONL file.") \
            from None
    problems = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NInferError(f"{path} line {n} is not JSON: {e}.", "Each line must be one JSON object.") from None
        missing = [f for f in FIELDS if not isinstance(row.get(f) if isinstance(row, dict) else None, str)]
        if missing:
            raise NInferError(f"{path} line {n} lacks the text field(s) {', '.join(missing)}.",
                              "Each problem needs task_id, prompt, entry_point and test (HumanEval's format).")
        problems.append(row)
    if not problems:
        raise NInferError(f"{path} holds no problem.", "Give --problems a file with one problem per line.")
    return problems


def cut(completion: str) -> str:
    """The continuation up to the first line that starts a new top-level statement."""
    end = min((i for i in (completion.find(s) for s in STOPS) if i >= 0), default=len(completion))
    return completion[:end]


def program(problem: dict, completion: str) -> str:
    """What runs: prompt, continuation, tests, and the call of check on the entry point (always appended)."""
    return (problem["prompt"] + cut(completion) + "\n\n" + problem["test"]
            + f"\n\ncheck({problem['entry_point']})\n")


def run(settings: Any, args, results_path: Path | None, progress) -> dict[str, Any]:
    from engine.tools.eval.target import ENGINE_KEYS, open_target

    if args.max_tokens < 1 or args.timeout <= 0 or args.memory_mib < 64 or args.limit < 0:
        raise NInferError("The code check needs --max-tokens >= 1, --timeout > 0, --memory-mib >= 64 and "
                          "--limit >= 0.", "E.g. --max-tokens 384 --timeout 10 --memory-mib 1024.")
    path = args.problems or PROBLEMS
    problems = load_problems(path)[:args.limit or None]
    limits = Limits(timeout_s=args.timeout, cpu_s=max(1, int(args.timeout)), memory_mib=args.memory_mib)
    where = {"url": args.url, "model": settings.model_id} if args.url \
        else {k: getattr(settings, k) for k in ENGINE_KEYS}
    digest = hashlib.sha256(json.dumps(problems, sort_keys=True).encode()).hexdigest()
    key = config_key({"target": where, "problems": digest, "max_tokens": args.max_tokens, "limits": limits,
                      "stops": STOPS})
    results = ResultsFile(results_path, "code", key)
    todo = [p for p in problems if p["task_id"] not in results.done]
    info: dict[str, Any] = {"key": key, "problems": path.name, "resumed": len(problems) - len(todo), "target": None}
    if todo:
        target, _ = open_target(args, settings, args.max_tokens)
        try:
            info["target"] = target.describe()
            for p in progress(todo, desc="code", unit="problem"):
                completion = target.complete(p["prompt"], args.max_tokens)
                outcome = run_program(program(p, completion), limits)
                results.add(p["task_id"], {"passed": outcome.passed, "status": outcome.status,
                                           "detail": outcome.detail[-300:], "completion": cut(completion)[:2000]})
        finally:
            target.close()
    rows = [results.done[p["task_id"]] for p in problems]
    passed = sum(r["passed"] for r in rows)
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {**info, "passed": passed, "items": len(rows), "ci95": wilson(passed, len(rows)), "statuses": statuses,
            "failed": [r["id"] for r in rows if not r["passed"]]}


def format_table(summary: dict[str, Any], command: str) -> str:
    lines = [f"ninfer-eval code: {command}"]
    if summary["target"]:
        lines.append("  target: " + ", ".join(f"{k} {v}" for k, v in summary["target"].items()))
    lines += [f"  problems: {summary['problems']}" + (f" ({summary['resumed']} from the results file)"
                                                      if summary["resumed"] else ""), "",
              "| passed | " + " | ".join(sorted(summary["statuses"])) + " |",
              "|---" * (len(summary["statuses"]) + 1) + "|",
              f"| {rate_text(summary['passed'], summary['items'])} | "
              + " | ".join(str(summary["statuses"][s]) for s in sorted(summary["statuses"])) + " |"]
    return "\n".join(lines)
