"""``ninfer-eval agent``: tasks through the chat tools API (/v1/chat/completions), as agent clients use it.

The bundled tasks (resources/eval/agent_tasks.json) are of four kinds:

- ``tool_call``: call the right tool with the right arguments (strings compared without case, numbers as numbers;
  the first call of the answer is graded);
- ``extract_json``: pull fields out of a messy message into a JSON object (the first object in the answer);
- ``root_cause``: read a log and name the root cause (the answer must name one of the expected words);
- ``fix_code``: fix a failing function, multi-turn, with two tools the check executes: ``run_tests`` (the current
  code and the tests in the sandbox, sandbox.py) and ``write_code`` (replaces the code); up to --max-turns
  answers. The task passes when the final code passes the tests, run again by the check.

In process, the engine is served by ninfer-serve's own app on a local port for the run (so the chat template and
the tool-call parsing are the server's); with --url, any OpenAI-compatible server is used."""
from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.errors import NInferError
from engine.tools.eval.results import ResultsFile, config_key
from engine.tools.eval.sandbox import Limits, run_program
from engine.tools.eval.stats import rate_text, wilson

TASKS = Path(__file__).resolve().parents[3] / "resources" / "eval" / "agent_tasks.json"
CODE_TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests against the current code.",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "write_code", "description": "Replace the whole function's code.",
                                      "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                     "required": ["code"]}}}]


def add_arguments(p) -> None:
    p.add_argument("--max-turns", type=int, default=6, help="answers allowed per fix_code task (default 6)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per answer (default 512)")
    p.add_argument("--limit", type=int, default=0, help="run only the first N tasks (0: all)")


def chat(client, url: str, model: str, messages: list[dict], tools: list[dict] | None, max_tokens: int) -> dict:
    """One greedy answer: the choice's message (content and tool_calls)."""
    import httpx

    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens}
    if tools:
        body["tools"] = tools
    try:
        r = client.post(url + "/chat/completions", json=body)
    except httpx.HTTPError as e:
        raise NInferError(f"Cannot reach {url}/chat/completions: {e}.", "Check --url and that the server runs.") \
            from None
    if r.status_code != 200:
        raise NInferError(f"{url}/chat/completions answered {r.status_code}: {r.text[:300]}",
                          "Check --url, the API key and that the server offers tools in chat completions.")
    try:
        return r.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise NInferError(f"{url}/chat/completions answered without choices[0].message: {r.text[:300]}",
                          "Use an OpenAI-compatible server.") from None


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        try:
            return abs(float(got) - float(expected)) < 1e-9
        except (TypeError, ValueError):
            return False
    return str(got).strip().casefold() == str(expected).strip().casefold()


def _calls(message: dict) -> list[tuple[str, dict]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = None
        out.append((str(fn.get("name")), args if isinstance(args, dict) else {}))
    return out


def first_json_object(text: str) -> dict | None:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        value = json.loads(text[start:end + 1])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def grade(task: dict, ask) -> dict[str, Any]:
    """Runs one task with ``ask(messages, tools)`` -> message; returns its record (passed, what was answered)."""
    messages = [{"role": "user", "content": task["prompt"]}]
    kind = task["kind"]
    if kind == "fix_code":
        return _fix_code(task, messages, ask)
    message = ask(messages, task.get("tools"))
    content = message.get("content") or ""
    if kind == "tool_call":
        calls = _calls(message)
        want = task["expect"]
        ok = bool(calls) and calls[0][0] == want["name"] and all(
            k in calls[0][1] and _same(v, calls[0][1][k]) for k, v in want["arguments"].items())
        return {"passed": ok, "answer": json.dumps(calls)[:300] if calls else content[:300]}
    if kind == "extract_json":
        got = first_json_object(content) or {}
        ok = all(k in got and _same(v, got[k]) for k, v in task["expect"].items())
        return {"passed": ok, "answer": content[:300]}
    if kind == "root_cause":
        ok = any(re.search(rf"\b{re.escape(w)}", content, re.IGNORECASE) for w in task["expect"]["any"])
        return {"passed": ok, "answer": content[:300]}
    raise NInferError(f"Task {task.get('id')} has the unknown kind {kind!r}.",
                      "Kinds are tool_call, extract_json, root_cause and fix_code.")


def _fix_code(task: dict, messages: list[dict], ask, limits: Limits = Limits(timeout_s=10, cpu_s=5)) -> dict:
    code, turns, used = task["code"], 0, []
    for turns in range(1, task.get("max_turns", 6) + 1):
        message = ask(messages, CODE_TOOLS)
        calls = message.get("tool_calls") or []
        messages.append({"role": "assistant", "content": message.get("content") or "", "tool_calls": calls} if calls
                        else {"role": "assistant", "content": message.get("content") or ""})
        if not calls:
            break
        for call, (name, args) in zip(calls, _calls(message)):
            used.append(name)
            if name == "run_tests":
                out = run_program(code + "\n\n" + task["tests"], limits)
                result = "All tests passed." if out.passed else f"Tests failed ({out.status}):\n{out.detail}"
            elif name == "write_code" and isinstance(args.get("code"), str):
                code, result = args["code"], "Saved."
            else:
                result = f"Unknown tool or arguments: {name}."
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
    final = run_program(code + "\n\n" + task["tests"], limits)
    return {"passed": final.passed, "turns": turns, "tools": used, "answer": code[:600]}


@contextmanager
def served(settings):
    """The engine built from ``settings``, served by ninfer-serve's app on a free local port; yields the base URL."""
    import socket

    import uvicorn

    from engine.build import build_engine
    from engine.config.engine_config import EngineConfig
    from engine.model.loader import resolve_model_path
    from engine.serve import served_model_ids
    from engine.server.app import create_app
    from engine.server.state import ServerState

    loaded = build_engine(settings.model, EngineConfig.from_settings(settings))
    loaded.engine.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = ServerState(settings, served_model_ids(settings, resolve_model_path(settings.model)))
    state.loaded = loaded
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            if time.time() > deadline or not thread.is_alive():
                raise NInferError("The local server for the agent check did not start.", "See the log above.")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        loaded.engine.shutdown()


def run(settings: Any, args, results_path: Path | None, progress) -> dict[str, Any]:
    import httpx

    from engine.tools.eval.target import ENGINE_KEYS, RemoteTarget

    if args.max_turns < 1 or args.max_tokens < 1 or args.limit < 0:
        raise NInferError("The agent check needs --max-turns >= 1, --max-tokens >= 1 and --limit >= 0.",
                          "E.g. --max-turns 6.")
    tasks = json.loads(TASKS.read_text(encoding="utf-8"))[:args.limit or None]
    where = {"url": args.url, "model": settings.model_id} if args.url \
        else {k: getattr(settings, k) for k in ENGINE_KEYS}
    key = config_key({"target": where, "tasks": tasks, "max_turns": args.max_turns, "max_tokens": args.max_tokens})
    results = ResultsFile(results_path, "agent", key)
    todo = [t for t in tasks if t["id"] not in results.done]
    info: dict[str, Any] = {"key": key, "resumed": len(tasks) - len(todo), "target": None}
    if todo:
        with (served(settings) if not args.url else _nothing(args.url)) as url:
            remote = RemoteTarget(url, settings.api_key, (settings.model_id or [None])[0])
            info["target"] = remote.describe()
            try:
                def ask(messages, tools):
                    return chat(remote.client, remote.url, remote.model, messages, tools, args.max_tokens)
                for task in progress(todo, desc="agent", unit="task"):
                    results.add(task["id"], {"kind": task["kind"],
                                             **grade({**task, "max_turns": args.max_turns}, ask)})
            except httpx.HTTPError as e:
                raise NInferError(f"The server failed during the agent check: {e}.", "See its log.") from None
            finally:
                remote.close()
    rows = [results.done[t["id"]] for t in tasks]
    kinds: dict[str, list[bool]] = {}
    for r in rows:
        kinds.setdefault(r["kind"], []).append(bool(r["passed"]))
    passed = sum(r["passed"] for r in rows)
    return {**info, "passed": passed, "items": len(rows), "ci95": wilson(passed, len(rows)),
            "by_kind": {k: {"passed": sum(v), "total": len(v)} for k, v in kinds.items()}}


@contextmanager
def _nothing(url: str):
    yield url


def format_table(summary: dict[str, Any], command: str) -> str:
    lines = [f"ninfer-eval agent: {command}"]
    if summary["target"]:
        lines.append("  target: " + ", ".join(f"{k} {v}" for k, v in summary["target"].items()))
    lines += [f"  passed {rate_text(summary['passed'], summary['items'])}"
              + (f" ({summary['resumed']} from the results file)" if summary["resumed"] else ""), "",
              "| task kind | passed |", "|---|---|"]
    lines += [f"| {k} | {v['passed']}/{v['total']} |" for k, v in summary["by_kind"].items()]
    return "\n".join(lines)
