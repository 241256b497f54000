"""``ninfer-eval CHECK``: the checks to run before trusting a configuration (docs/EVAL.md).

The engine is built in this process from the same settings ``ninfer-serve`` takes (every flag, NINFER_*
environment variable, --preset and --config, parsed by engine.config.loading), or a server is reached with --url. Each
check writes one line per finished item to a resumable results file (--results) and prints a Markdown table."""
from __future__ import annotations

import json
import sys

from engine.errors import NInferError
from engine.tools.eval.options import CHECKS, parse, progress_bar
from engine.userfiles import check_write_target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:  # A and B are quoted flag strings: compare parses its own arguments
        from engine.tools.eval import compare

        return compare.main(argv[1:])
    command = "ninfer-eval " + " ".join(argv)
    try:
        args, settings = parse(argv)
        for flag, path in (("--results", args.results), ("--json", args.json)):  # refused before any work
            if path is not None:
                check_write_target(path, f"the {flag} file", f"Give another {flag} path.")
    except NInferError as e:
        print(f"{e}", file=sys.stderr)
        return 2
    module = CHECKS[args.check]
    try:
        summary = module.run(settings, args, args.results, progress_bar(not args.no_progress))
    except NInferError as e:
        print(f"ninfer-eval {args.check}: {e}", file=sys.stderr)
        return 1
    table = module.format_table(summary, command)
    print(table)
    if args.json:
        try:  # the printed table goes along, so a reader of the report (the app) needs no code of the check
            args.json.write_text(json.dumps({"command": command, "check": args.check, "engine_flags": args.engine_flags,
                                             "table": table, **summary}, indent=2, default=str))
        except OSError as e:
            print(f"ninfer-eval: cannot write {args.json}: {e}; give a writable --json path", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
