"""ninfer-eval agent through a stand-in OpenAI chat server: a scripted agent that calls the right tools, extracts the
fields, names the root cause and fixes the code after run_tests shows the failure passes every task; one that gets
them wrong fails every task. The fix_code tools are executed by the check (run_tests in the sandbox), and the final
code is tested again by the check, whatever the agent claims."""
from __future__ import annotations

import json

import pytest

from engine.tools.eval import agent, cli

FIXES = {"average": "def average(numbers):\n    return sum(numbers) / len(numbers)\n",
         "slug": "def slug(title):\n    return '-'.join(title.lower().split())\n"}


def _reply(message: dict) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop"}]}


def _call(name: str, args: dict, n: int = 0) -> dict:
    return {"content": None, "tool_calls": [{"id": f"call_{n}", "type": "function",
                                             "function": {"name": name, "arguments": json.dumps(args)}}]}


def _scripted(good: bool, seen: list):
    import httpx

    tasks = {t["prompt"]: t for t in json.loads(agent.TASKS.read_text())}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "scripted"}]})
        body = json.loads(request.content)
        seen.append(body)
        task = tasks[body["messages"][0]["content"]]
        if task["kind"] == "tool_call":
            want = task["expect"]
            args = dict(want["arguments"]) if good else {**want["arguments"], next(iter(want["arguments"])): "?"}
            return httpx.Response(200, json=_reply(_call(want["name"], args)))
        if task["kind"] == "extract_json":
            text = "Sure! ```json\n" + json.dumps(task["expect"]) + "\n```" if good else "I could not find it."
            return httpx.Response(200, json=_reply({"content": text}))
        if task["kind"] == "root_cause":
            words = {"log-disk": "The disk is full: no space left on device.",
                     "log-db": "The database at 10.0.0.7:5432 refuses connections."}
            return httpx.Response(200, json=_reply({"content": words[task["id"]] if good else "A network hiccup."}))
        tool_results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
        name = task["code"].split("(")[0].split()[-1]
        if not tool_results:
            return httpx.Response(200, json=_reply(_call("run_tests", {}, 1)))
        if tool_results[-1].startswith("Tests failed"):
            code = FIXES[name] if good else f"def {name}(*args):\n    pass\n"
            return httpx.Response(200, json=_reply(_call("write_code", {"code": code}, 2)))
        if tool_results[-1] == "Saved.":
            return httpx.Response(200, json=_reply(_call("run_tests", {}, 3)))
        return httpx.Response(200, json=_reply({"content": "Fixed: the tests pass."}))
    return httpx.MockTransport(handle)


@pytest.mark.parametrize("good", [True, False])
def test_agent_tasks_are_graded(good, tmp_path, monkeypatch):
    from engine.tools.eval import target

    seen: list = []
    real = target.RemoteTarget
    monkeypatch.setattr(target, "RemoteTarget", lambda *a, **k: real(*a, **k, transport=_scripted(good, seen)))
    out = tmp_path / "agent.json"
    assert cli.main(["agent", "--url", "http://server:8000", "--no-progress", "--json", str(out),
                     "--results", str(tmp_path / "agent.jsonl")]) == 0
    s = json.loads(out.read_text())
    assert s["items"] == 10 and set(s["by_kind"]) == {"tool_call", "extract_json", "root_cause", "fix_code"}
    assert s["passed"] == (10 if good else 0)
    assert all(b["temperature"] == 0.0 for b in seen)
    fix_turns = [b for b in seen if b["messages"][0]["content"].startswith("The function below fails")]
    tool_msgs = [m for b in fix_turns for m in b["messages"] if m["role"] == "tool"]
    assert any(m["content"].startswith("Tests failed (failed):\n") and "AssertionError" in m["content"]
               for m in tool_msgs)  # run_tests really ran the buggy code in the sandbox
    if good:
        assert any(m["content"] == "All tests passed." for m in tool_msgs)
        rows = [json.loads(line) for line in (tmp_path / "agent.jsonl").read_text().splitlines()]
        assert {r["id"]: r.get("tools") for r in rows if r["kind"] == "fix_code"} == \
            {"fix-average": ["run_tests", "write_code", "run_tests"], "fix-slug": ["run_tests", "write_code", "run_tests"]}


def test_a_claim_without_a_fix_fails():
    task = next(t for t in json.loads(agent.TASKS.read_text()) if t["kind"] == "fix_code")
    record = agent.grade(task, lambda messages, tools: {"content": "All fixed, the tests pass now."})
    assert not record["passed"] and record["turns"] == 1


def test_json_is_found_in_a_chatty_answer():
    assert agent.first_json_object('Here: ```json\n{"a": 1}\n``` done') == {"a": 1}
    assert agent.first_json_object("no json") is None


@pytest.mark.slow
def test_agent_in_process_on_the_default_model(tmp_path):
    out = tmp_path / "agent.json"
    assert cli.main(["agent", "--limit", "2", "--max-tokens", "32", "--max-context", "2048", "--no-progress",
                     "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["items"] == 2 and s["by_kind"]["tool_call"]["total"] == 2 and s["target"]["model"]
