"""MCP tools in the chat window, through what a user clicks: an MCP server (tests/app/mcp_server.py, on the SDK) added
in MCP servers… and tested there, picked under Tools, a tool call that waits for Approve once / Always for this tool
/ Deny, runs, and whose result reaches the model's next request; Stop ends the loop; a crashing server, a slow tool
and the cap on calls per answer end in clear transcript messages; tools and results are saved and exported.

The model is a stand-in (ScriptedClient) that answers each request from a script (a tool call, then text) and keeps
every request body, so each test checks what the model was sent; the tiny default model does not call tools
reliably. The servers are real: a subprocess over stdio, or another process over streamable HTTP."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtTest import QTest

from app.client import ChatEvent

from tests.app.conftest import free_port, make_controller, run, wait_until
from tests.app.fakes import FakeClient

pytestmark = pytest.mark.subprocess  # the MCP servers are other processes (stdio subprocesses, an HTTP server)

SERVER = Path(__file__).resolve().parent / "mcp_server.py"
CHAT = {"mode": "chat", "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 40}}
SLOW_MS = 40_000  # starting a server (Python importing the SDK) on a busy 2-CPU machine


class ScriptedClient(FakeClient):
    """Answers request k with ``script[k]`` (the last one again once the script runs out): ("call", tool, args)
    streams a tool call in two parts, ("text", words) an answer. Every request body is kept in ``requests``."""

    def __init__(self, script):
        super().__init__(dict(CHAT))
        self.script = list(script)

    async def stream_chat(self, model, messages, **params):
        self.requests.append(json.loads(json.dumps({"model": model, "messages": messages, **params})))
        kind, *rest = self.script[min(len(self.requests), len(self.script)) - 1]
        await asyncio.sleep(0.02)
        if kind == "call":
            name, args = rest
            call = {"id": f"call_{len(self.requests)}", "type": "function",
                    "function": {"name": name, "arguments": ""}}
            yield ChatEvent("tool_calls", data=[json.loads(json.dumps(call))])  # the name first, as a stream does
            await asyncio.sleep(0.02)
            call["function"]["arguments"] = json.dumps(args)
            yield ChatEvent("tool_calls", data=[call])
            yield ChatEvent("finish", "tool_calls")
        else:
            yield ChatEvent("content", rest[0])
            yield ChatEvent("finish", "stop")
        yield ChatEvent("usage", data={"prompt_tokens": 20, "completion_tokens": 5})


def stdio_entry(**env) -> dict:
    entry = {"command": sys.executable, "args": [str(SERVER)]}
    return {**entry, "env": env} if env else entry


def open_chat(app_home, tmp_path, name: str, script, servers: dict | None = None):
    controller = make_controller(app_home, name)
    client = ScriptedClient(script)
    controller.client, controller.model_id = client, "fake-model"
    run(controller.refresh_mode())
    controller.show_main()
    chat = controller.window.chat
    chat.tools.path = tmp_path / "mcp.json"
    if servers is not None:
        chat.tools.path.write_text(json.dumps({"mcpServers": servers}))
    chat.show_tools([])
    return controller, chat, client


@pytest.fixture
def opened(qapp, qloop, app_home, tmp_path, request):
    made = []

    def make(script, servers=None):
        made.append(open_chat(app_home, tmp_path, request.node.name, script, servers))
        return made[-1]

    yield make
    for controller, chat, _ in made:
        chat.stop()
        wait_until(lambda: not chat.busy, 10_000)
        chat.tools.close()
        controller.quitting = True
        controller.client = None
        controller.window.hide()


def pick_server(chat, name: str = "tests") -> None:
    """Tools ▸ the server's checkbox."""
    if not chat.tools_bar.isVisible():
        QTest.mouseClick(chat.tools_toggle, Qt.MouseButton.LeftButton)
    box = chat.tools_bar.boxes[name]
    QTest.mouseClick(box, Qt.MouseButton.LeftButton, pos=QPoint(8, box.height() // 2))
    assert box.isChecked() and chat.tools_toggle.text() == "Tools (1)"


def send(chat, text: str) -> None:
    wait_until(chat.send_button.isEnabled, 5000)
    QTest.keyClicks(chat.input, text)
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    assert not chat.input.toPlainText(), "the message was not sent"


def click(button) -> None:
    QTest.mouseClick(button, Qt.MouseButton.LeftButton)


def wait_done(chat, timeout: int = SLOW_MS) -> None:
    wait_until(lambda: not chat.busy and chat.send_button.isEnabled(), timeout)


def tool_messages(request: dict) -> list[dict]:
    return [m for m in request["messages"] if m["role"] == "tool"]


# ---- the whole way: add the server, test it, pick it, approve a call, the result reaches the model ----------------
def test_a_server_added_and_tested_in_the_dialog_runs_an_approved_call_whose_result_reaches_the_model(
        opened, tmp_path):
    controller, chat, client = opened([("call", "tests__add", {"a": 2, "b": 3}), ("text", "2 + 3 is 5.")])
    assert "No MCP servers yet" in chat.tools_bar.note.text()
    click(chat.tools_toggle)
    click(chat.tools_bar.edit_button)
    dialog = chat.mcp_dialog
    wait_until(dialog.isVisible)
    click(dialog.add_button)
    QTest.keyClicks(dialog.name, "tests")  # replaces the proposed name, which is selected
    QTest.keyClicks(dialog.command, sys.executable)
    QTest.keyClicks(dialog.args, str(SERVER))
    click(dialog.test_button)
    wait_until(lambda: "Connected" in dialog.test_result.text(), SLOW_MS)
    assert dialog.test_result.text() == "✓ Connected: 2 tools: add, slow"
    click(dialog.save_button)
    assert not dialog.isVisible()
    assert json.loads(chat.tools.path.read_text())["mcpServers"]["tests"]["args"] == [str(SERVER)]

    pick_server(chat)
    send(chat, "What is 2 + 3?")
    wait_until(chat.approval.isVisible, SLOW_MS)
    text = chat.approval.label.text()
    assert "add" in text and "tests" in text and '{"a": 2, "b": 3}' in text
    assert "Tool call" in chat.view.toPlainText() and "tests__add" in chat.view.toPlainText()  # shown as it streamed
    click(chat.approval.approve_button)
    wait_done(chat)

    first, second = client.requests
    assert [t["function"]["name"] for t in first["tools"]] == ["tests__add", "tests__slow"]
    assert first["temperature"] == 0.2 and first["top_p"] == 0.8  # Agent mode's sampling while tools are on
    result = tool_messages(second)
    assert result == [{"role": "tool", "content": "5", "tool_call_id": "call_1"}]
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == "tests__add"
    shown = chat.view.toPlainText()
    assert "▸ Result of tests__add" in shown and "2 + 3 is 5." in shown

    saved = controller.store.messages(chat.conversation.id)
    assert [m.role for m in saved] == ["user", "assistant", "tool", "assistant"]
    assert saved[2].content == "5" and saved[2].stats["server"] == "tests"
    assert controller.store.get(chat.conversation.id).tools == ["tests"]
    window = controller.window
    window.ask = False
    assert window.export_conversation(str(tmp_path / "chat.json")) is None
    exported = json.loads((tmp_path / "chat.json").read_text())
    assert exported["tools"] == ["tests"] and exported["messages"][2]["stats"]["tool_call_id"] == "call_1"
    assert window.export_conversation(str(tmp_path / "chat.md")) is None
    assert "## Tool result `tests__add`" in (tmp_path / "chat.md").read_text()


def test_the_dialog_shows_a_broken_mcp_json_as_it_stands_to_fix_it(opened):
    controller, chat, client = opened([("text", "Hi.")], {"files": {"command": "npx", "args": "-y server-fs"},
                                                          "web": {"url": "http://127.0.0.1:9/mcp"}})
    assert 'server "files": "args" must be a list of strings' in chat.tools_bar.note.text()
    chat.edit_servers()
    dialog = chat.mcp_dialog
    wait_until(dialog.isVisible)
    assert [dialog.list.item(i).text() for i in range(dialog.list.count())] == ["files", "web"]
    assert '"args" must be a list of strings' in dialog.problem.text() and dialog.args.text() == "-y server-fs"
    QTest.keyClicks(dialog.args, " /tmp")  # the form's arguments are words, as in a shell: now a list
    click(dialog.save_button)
    assert not dialog.isVisible()
    saved = json.loads(chat.tools.path.read_text())["mcpServers"]
    assert saved["files"]["args"] == ["-y", "server-fs", "/tmp"] and saved["web"] == {"url": "http://127.0.0.1:9/mcp"}
    assert set(chat.tools_bar.boxes) == {"files", "web"}


# ---- deny, always -------------------------------------------------------------------------------------------------
def test_deny_tells_the_model_and_always_stops_asking_for_that_tool(opened):
    controller, chat, client = opened([("call", "tests__add", {"a": 1, "b": 1}), ("text", "OK.")],
                                      {"tests": stdio_entry()})
    pick_server(chat)
    send(chat, "Add 1 and 1")
    wait_until(chat.approval.isVisible, SLOW_MS)
    click(chat.approval.deny_button)
    wait_done(chat)
    assert tool_messages(client.requests[1])[0]["content"] == "The user denied this tool call."
    assert "The user denied this tool call." in chat.view.toPlainText()

    client.script = [("call", "tests__add", {"a": 1, "b": 1}), ("text", "Two.")]
    client.requests.clear()
    send(chat, "Now do it")
    wait_until(chat.approval.isVisible, SLOW_MS)
    click(chat.approval.always_button)
    wait_done(chat)
    assert tool_messages(client.requests[1])[-1]["content"] == "2"
    assert controller.config.get("mcp_always") == {"tests": ["add"]}

    client.requests.clear()
    send(chat, "Once more")  # no approval asked: were it, the turn would wait for it and this would time out
    wait_until(lambda: len(client.requests) == 2 and not chat.busy, SLOW_MS)
    assert not chat.approval.isVisible() and tool_messages(client.requests[1])[-1]["content"] == "2"


# ---- stop -----------------------------------------------------------------------------------------------------------
def test_stop_ends_the_loop_while_a_call_waits_for_approval_and_while_it_runs(opened):
    controller, chat, client = opened([("call", "tests__slow", {"seconds": 30}), ("text", "never")],
                                      {"tests": stdio_entry()})
    pick_server(chat)
    send(chat, "Wait")
    wait_until(chat.approval.isVisible, SLOW_MS)
    click(chat.stop_button)
    wait_done(chat, 10_000)
    assert not chat.approval.isVisible() and len(client.requests) == 1
    assert chat.messages[-1].role == "tool" and chat.messages[-1].stats.get("stopped")
    assert "Stop was pressed" in chat.view.toPlainText()

    client.requests.clear()  # the script starts again: a call of slow first
    send(chat, "Wait again")
    wait_until(chat.approval.isVisible, SLOW_MS)
    click(chat.approval.approve_button)
    end = time.monotonic() + 1.5
    wait_until(lambda: time.monotonic() > end, 3000)  # the call is running on the server now
    assert chat.busy and not chat.approval.isVisible()
    t0 = time.monotonic()
    click(chat.stop_button)
    wait_done(chat, 10_000)
    assert time.monotonic() - t0 < 5 and len(client.requests) == 1  # no request after the stopped call
    saved = controller.store.messages(chat.conversation.id)
    assert saved[-1].role == "tool" and saved[-1].stats.get("stopped")


# ---- a crashing server, a slow tool, the cap ---------------------------------------------------------------------
def test_a_crashing_server_and_a_slow_tool_end_in_clear_transcript_errors(opened):
    controller, chat, client = opened([("call", "tests__add", {"a": 1, "b": 2}), ("text", "It failed.")],
                                      {"tests": stdio_entry(MCP_TEST_CRASH="1")})
    controller.config.set("mcp_always", {"tests": ["add", "slow"]})
    chat.tools.approvals.always = {"tests": ["add", "slow"]}
    pick_server(chat)
    send(chat, "Add")
    wait_done(chat)
    crash = tool_messages(client.requests[1])[0]["content"]
    assert 'The MCP server "tests" stopped' in crash and "crashing on purpose" in crash
    shown = chat.view.toPlainText()
    assert "⚠ tests__add: The MCP server \"tests\" stopped" in shown and "It failed." in shown

    chat.tools.path.write_text(json.dumps({"mcpServers": {"tests": stdio_entry()}}))
    chat.tools.set_limits(8, 1)
    client.script = [("call", "tests__slow", {"seconds": 30}), ("text", "Too slow.")]
    client.requests.clear()
    t0 = time.monotonic()
    send(chat, "Sleep")
    wait_done(chat)
    assert time.monotonic() - t0 < SLOW_MS / 1000
    slow = tool_messages(client.requests[1])[-1]["content"]
    assert 'did not run slow within 1 s' in slow and "Raise the time limit in MCP servers" in slow
    assert "⚠ tests__slow" in chat.view.toPlainText()


def test_the_cap_on_calls_per_answer_ends_the_loop(opened):
    controller, chat, client = opened([("call", "tests__add", {"a": 1, "b": 2})], {"tests": stdio_entry()})
    chat.tools.approvals.always = {"tests": ["add"]}
    chat.tools.set_limits(2, 20)
    pick_server(chat)
    send(chat, "Keep adding")
    wait_done(chat)
    assert len(client.requests) == 3  # two calls ran, the third answer's call was not run and the turn ended
    last = chat.messages[-1]
    assert last.role == "tool" and "reached its limit of 2 tool calls" in last.content


def test_a_server_that_cannot_start_is_named_above_the_answer_and_the_turn_goes_on(opened):
    controller, chat, client = opened([("text", "No tools, then.")],
                                      {"gone": {"command": "ninfer-no-such-mcp-server"}})
    pick_server(chat, "gone")
    send(chat, "Hello")
    wait_done(chat)
    assert "tools" not in client.requests[0]  # nothing to offer: a plain request
    shown = chat.view.toPlainText()
    assert '⚠ The MCP server "gone" could not be started' in shown and "Its tools are off" in shown
    assert "No tools, then." in shown


# ---- streamable HTTP ------------------------------------------------------------------------------------------------
@pytest.fixture
def http_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import socket
    deadline = time.monotonic() + SLOW_MS / 1000
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not start"
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def test_a_server_over_streamable_http_runs_an_approved_call(opened, http_server):
    controller, chat, client = opened([("call", "web__add", {"a": 20, "b": 22}), ("text", "42.")],
                                      {"web": {"url": http_server}})
    pick_server(chat, "web")
    send(chat, "Add over HTTP")
    wait_until(chat.approval.isVisible, SLOW_MS)
    click(chat.approval.approve_button)
    wait_done(chat)
    assert tool_messages(client.requests[1]) == [{"role": "tool", "content": "42", "tool_call_id": "call_1"}]


# ---- the real default model ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_default_models_forced_tool_call_is_approved_runs_and_its_result_reaches_its_next_request(
        started, tmp_path):
    """SmolLM2-135M through the embedded engine: "Call a tool first" sends tool_choice "required", which the engine
    enforces with a grammar, so the tiny model's first answer is a real call of one of the server's tools."""
    from engine.mcp.host import McpHost

    controller, window = started
    chat = window.chat
    client = controller.client
    sent: list[dict] = []
    real = client.stream_chat

    def recording(model, messages, **params):
        sent.append(json.loads(json.dumps({"messages": messages, **params})))
        return real(model, messages, **params)

    saved = {k: controller.config.get(k) for k in ("mcp_limits", "mcp_require_call", "mcp_always")}
    client.stream_chat = recording
    window.new_chat()
    chat.tools.path = tmp_path / "mcp.json"
    chat.tools.path.write_text(json.dumps({"mcpServers": {"tests": stdio_entry()}}))
    chat.tools.set_limits(2, 5)  # two calls at most; a slow(...) the model picks ends after 5 s
    chat.show_tools([])
    try:
        pick_server(chat)
        QTest.mouseClick(chat.tools_bar.require, Qt.MouseButton.LeftButton,
                         pos=QPoint(8, chat.tools_bar.require.height() // 2))
        assert chat.tools_bar.require.isChecked()
        chat.max_tokens = 96
        send(chat, "Use the add tool to add 2 and 3.")
        wait_until(chat.approval.isVisible, 120_000)
        click(chat.approval.approve_button)
        wait_until(lambda: not chat.approval.isVisible(), 10_000)
        while True:  # the model may ask again: each later call is denied, and the cap of 2 ends the turn anyway
            wait_until(lambda: not chat.busy or chat.approval.isVisible(), 120_000)
            if not chat.busy:
                break
            click(chat.approval.deny_button)
            wait_until(lambda: not chat.approval.isVisible(), 10_000)
        wait_done(chat, 120_000)
        assert sent[0]["tool_choice"] == "required" and "tool_choice" not in sent[1]
        call = chat.messages[1].tool_calls[0]
        assert call["function"]["name"] in ("tests__add", "tests__slow")
        result = tool_messages(sent[1])
        assert result and result[0]["tool_call_id"] == call["id"] == chat.messages[2].stats["tool_call_id"]
        if call["function"]["name"] == "tests__add":
            args = json.loads(call["function"]["arguments"])
            assert result[0]["content"] == str(args["a"] + args["b"])
    finally:
        chat.stop()
        wait_until(lambda: not chat.busy, 10_000)
        client.__dict__.pop("stream_chat", None)
        chat.max_tokens = None
        chat.tools.close()
        chat.tools.host = McpHost()
        for key, value in saved.items():
            controller.config.set(key, value)
        conv = chat.conversation
        window.new_chat()
        if conv is not None:
            controller.store.delete(conv.id)
            window.conversations.refresh()
        chat.tools.path.unlink()
        chat.show_tools([])
