"""ninfer-eval's command line: the checks, their options and the engine settings they take (the parsing shared by
`ninfer-eval CHECK` and `ninfer-eval compare`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.tools.eval import agent, code, count, kld, needle

CHECKS = {"kld": kld, "needle": needle, "count": count, "code": code, "agent": agent}
# ninfer-serve settings that mean something with --url: how to reach the server's model
URL_SETTINGS = {"api_key", "model_id"}
# checks whose engine settings still apply with --url: they build the reference in process (kld)
REFERENCE_IN_PROCESS = {"kld"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise NInferError(f"ninfer-eval: {message}.", "Run ninfer-eval CHECK --help for the options.")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ninfer-eval", allow_abbrev=False, description=(
        "Measure a configuration before trusting it. Engine settings are ninfer-serve's (see ninfer-serve --help): "
        "give them after the check, e.g. ninfer-eval kld --kv-dtype k8v4. ninfer-eval compare 'A FLAGS' 'B FLAGS' "
        "runs checks on two configurations side by side (ninfer-eval compare --help)."))
    sub = p.add_subparsers(dest="check", metavar="CHECK", required=True, parser_class=_Parser)
    helps = {"kld": "KL divergence, top-1 agreement and perplexity against a reference configuration (in process, "
                    "or a server's top-k logprobs with --url)",
             "needle": "pass-key retrieval over a grid of context lengths x depths; a table and a heatmap PNG",
             "count": "count a word's occurrences spread over the whole prompt (needs every part of the context)",
             "code": "small programming problems run with their tests in a sandbox (HumanEval format)",
             "agent": "tasks through the chat tools API: tool calls, JSON extraction, log reading, fixing code"}
    for name, module in CHECKS.items():
        s = sub.add_parser(name, help=helps[name], description=helps[name] + ". Any other option is a "
                           "ninfer-serve setting (ninfer-serve --help).", allow_abbrev=False)
        s.add_argument("--results", type=Path, default=None, metavar="FILE.jsonl",
                       help="resumable results file: items already in it (same check and configuration) are "
                            "skipped, new ones appended (default: none, nothing kept)")
        s.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the summary as JSON")
        s.add_argument("--no-progress", action="store_true", help="no progress bar on the terminal")
        s.add_argument("--url", default=None, help="evaluate an OpenAI-compatible server (its /v1/completions) "
                       "instead of the engine in process; --api-key / NINFER_API_KEY and --model-id apply"
                       + ("; the engine settings then describe the reference, run in process"
                          if name in REFERENCE_IN_PROCESS else ""))
        module.add_arguments(s)
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, Any]:
    """The check's own options and the engine settings (engine.config.loading.load_settings on everything else)."""
    from engine.config.loading import ConfigError, load_settings

    args, rest = build_parser().parse_known_args(argv)
    args.engine_flags = list(rest)  # the configuration, as given: reports name it (the app finds them by it)
    try:
        settings, warnings = load_settings(rest)
    except ConfigError as e:
        raise NInferError(f"{e}", e.remedy + " Engine settings are ninfer-serve's (ninfer-serve --help).") from None
    for w in warnings:
        print(f"ninfer-eval: warning: {w}", file=sys.stderr)
    if getattr(args, "url", None) and args.check not in REFERENCE_IN_PROCESS:
        ignored = sorted(n for n, src in settings.sources.items() if src.startswith(("flag:", "arg:"))
                         and n not in URL_SETTINGS)
        if ignored:
            raise NInferError(f"--url evaluates a server, whose settings are its own; these engine settings would "
                              f"be ignored: {', '.join(ignored)}.", "Drop them, or drop --url to build the engine "
                              "in process.")
    return args, settings


def progress_bar(enabled: bool):
    def bar(items, **kw):
        if not enabled:
            return items
        from tqdm import tqdm
        return tqdm(items, file=sys.stderr, dynamic_ncols=True, **kw)
    return bar
