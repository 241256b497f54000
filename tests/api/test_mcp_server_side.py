"""Server-side MCP tools (--mcp-config): a chat request naming a configured server gets its tools; the server runs
the model's calls to them (the SDK test server of tests/app/mcp_server.py over stdio) and feeds the results back
until the model answers. The model is scripted (tests/api/scripted.py) round by round, so what reaches its next
prompt is checked exactly; the last test lets the real default model make a forced call."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine.config.loading import load_settings
from engine.server.mcp_tools import MAX_CALLS
from engine.server.state import ServerState
from tests.api.conftest import RunningServer
from tests.api.scripted import ScriptedEngine

SERVER = str(Path(__file__).parents[1] / "app" / "mcp_server.py")
ADD = {"type": "mcp", "server_label": "calc"}
USER = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


class RoundsEngine(ScriptedEngine):
    """Says the next of `rounds` at each submission (the last one again when they run out)."""
    rounds: list[str] = []

    def submit(self, prompt, params, request_id=None, loop=None):
        self.script = self.rounds[min(len(self.prompts), len(self.rounds) - 1)]
        return super().submit(prompt, params, request_id, loop)


def mcp_json(tmp_path: Path, crash: bool = False) -> Path:
    env = {"MCP_TEST_CRASH": "1"} if crash else {}
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"calc": {"command": sys.executable, "args": [SERVER], "env": env}}}))
    return path


@pytest.fixture
def serve(default_engine, tmp_path):
    """serve(rounds, flags) -> (base URL, engine): a server over the rounds engine with those settings flags."""
    running = []

    def start(rounds: list[str], flags: list[str]):
        settings, _ = load_settings(flags, {})
        engine = RoundsEngine(default_engine.tokenizer)
        engine.rounds = rounds
        state = ServerState(settings, ["scripted"])
        state.loaded = SimpleNamespace(engine=engine, tokenizer=default_engine.tokenizer, context_window=2048)
        server = RunningServer(state).__enter__()
        running.append(server)
        return server.base_url, engine

    yield start
    for server in running:
        server.__exit__(None, None, None)
        if server.state.mcp is not None:
            server.state.mcp.close()


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120,
                      json={"model": "scripted", "messages": USER, "tools": [ADD], **body})


def test_a_call_runs_on_the_server_and_its_result_reaches_the_next_round(serve, tmp_path, default_engine):
    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    r = chat(url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "The sum is 5."
    assert body["choices"][0]["finish_reason"] == "stop"
    (ran,) = body["mcp_calls"]
    assert (ran["server_label"], ran["name"], ran["arguments"], ran["output"], ran["error"]) == \
        ("calc", "add", {"a": 2, "b": 3}, "5", False)
    assert len(engine.prompts) == 2
    first, second = (default_engine.tokenizer.decode(p) for p in engine.prompts)
    assert second.startswith(first[:len(first) // 2]), second  # the same chat, then the call and its result
    assert "tool\n5\n" in second and "5" not in first, second  # (this template leaves out the call itself)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(engine.prompts[0]) + len(engine.prompts[1])


def test_a_crashing_server_and_bad_arguments_are_results_the_model_reads(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "It failed."],
                        ["--mcp-config", str(mcp_json(tmp_path, crash=True))])
    body = chat(url).json()
    (ran,) = body["mcp_calls"]
    assert ran["error"] and "calc" in ran["output"], ran
    assert body["choices"][0]["message"]["content"] == "It failed."

    url, engine = serve([call_text("calc__add", {"a": "two", "b": 3}), "Sorry."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    body = chat(url).json()  # arguments the tool's schema refuses: the server says so, the model reads it
    assert body["mcp_calls"][0]["error"] and "valid integer" in body["mcp_calls"][0]["output"], body["mcp_calls"]
    assert "tool\n" in engine.tokenizer.decode(engine.prompts[1])


def test_calls_stop_at_the_cap_and_the_model_answers_without_tools(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": 1, "b": 1})] * (MAX_CALLS + 5),
                        ["--mcp-config", str(mcp_json(tmp_path))])
    engine.rounds = engine.rounds + ["Done."]
    body = chat(url).json()
    assert len(body["mcp_calls"]) == MAX_CALLS
    assert len(engine.prompts) == MAX_CALLS + 1  # then one round with tool_choice none
    assert engine.params[-1].constraint is None


def test_refusals_name_the_setting_or_field(serve, tmp_path):
    url, _ = serve(["x"], [])
    r = chat(url)
    assert r.status_code == 400 and "--mcp-config" in r.json()["error"]["message"]
    url, _ = serve(["x"], ["--mcp-config", str(mcp_json(tmp_path))])
    r = chat(url, tools=[{"type": "mcp", "server_label": "nope"}])
    assert r.status_code == 400 and "'calc'" in r.json()["error"]["message"]
    r = chat(url, tools=[dict(ADD, require_approval="always")])
    assert r.status_code == 400 and "require_approval" in r.json()["error"]["message"]
    r = chat(url, n=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = chat(url, tools=[dict(ADD, server_url="http://127.0.0.1:9/mcp")])  # calc runs as a command, not a URL
    assert r.status_code == 400 and "server_url" in r.json()["error"]["message"]
    url, _ = serve(["x"], ["--mcp-config", str(tmp_path / "missing.json")])
    r = chat(url)
    assert r.status_code == 500 and "not a file" in r.json()["error"]["message"]


def test_streamed_the_final_answer_comes_in_chunks_and_the_calls_in_a_last_chunk(serve, tmp_path):
    url, engine = serve([call_text("calc__add", {"a": 2, "b": 3}), "The sum is 5."],
                        ["--mcp-config", str(mcp_json(tmp_path))])
    r = chat(url, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200, r.text
    lines = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    chunks = [json.loads(line) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1  # one completion over the rounds
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and sum("role" in d for d in deltas) == 1
    assert not [d for d in deltas if d.get("tool_calls")]  # the round of calls ran here: not shown as calls
    assert "".join(d.get("content") or "" for d in deltas) == "The sum is 5."
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]
    (summary,) = [c for c in chunks if "mcp_calls" in c]
    assert summary["choices"] == [] and [(m["name"], m["output"]) for m in summary["mcp_calls"]] == [("add", "5")]
    assert chunks[-1]["usage"]["prompt_tokens"] == len(engine.prompts[0]) + len(engine.prompts[1])
    assert "tool\n5\n" in engine.tokenizer.decode(engine.prompts[1])
    from openai.types.chat import ChatCompletionChunk
    for c in chunks:
        ChatCompletionChunk.model_validate(c)


def test_off_loopback_without_a_key_is_refused(serve, tmp_path):
    url, _ = serve(["x"], ["--mcp-config", str(mcp_json(tmp_path)), "--host", "0.0.0.0", "--insecure-no-auth"])
    r = chat(url)
    assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]


@pytest.mark.slow
def test_the_default_model_makes_a_forced_call_that_runs(default_engine, tmp_path):
    settings, _ = load_settings(["--mcp-config", str(mcp_json(tmp_path))], {})
    state = ServerState(settings, ["smol"])
    state.loaded = default_engine
    try:
        with RunningServer(state) as running:
            r = httpx.post(running.base_url + "/v1/chat/completions", timeout=300, json={
                "model": "smol", "messages": USER, "tools": [ADD], "temperature": 0, "max_tokens": 48,
                "tool_choice": {"type": "function", "function": {"name": "calc__add"}}})
    finally:
        state.mcp.close()
    assert r.status_code == 200, r.text
    ran = r.json()["mcp_calls"]
    assert ran and ran[0]["name"] == "add" and not ran[0]["error"], ran
    a, b = ran[0]["arguments"]["a"], ran[0]["arguments"]["b"]
    assert ran[0]["output"] == str(a + b)  # the grammar made schema-valid arguments; the tool added them


@pytest.mark.slow
def test_the_default_model_makes_a_forced_call_streamed_through_the_openai_client(default_engine, tmp_path):
    import openai

    settings, _ = load_settings(["--mcp-config", str(mcp_json(tmp_path))], {})
    state = ServerState(settings, ["smol"])
    state.loaded = default_engine
    try:
        with RunningServer(state) as running:
            client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none")
            chunks = list(client.chat.completions.create(
                model="smol", messages=USER, tools=[ADD], temperature=0, max_tokens=48, stream=True,
                tool_choice={"type": "function", "function": {"name": "calc__add"}}))
    finally:
        state.mcp.close()
    (summary,) = [c for c in chunks if (c.model_extra or {}).get("mcp_calls") is not None]
    ran = summary.model_extra["mcp_calls"]
    assert ran and ran[0]["name"] == "add" and not ran[0]["error"], ran
    assert ran[0]["output"] == str(ran[0]["arguments"]["a"] + ran[0]["arguments"]["b"])
    assert not [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]  # the calls ran on the server
