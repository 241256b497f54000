"""engine/mcp: mcp.json read and checked (every problem named by server and field), tool names for the model, and
sessions on the official SDK against tests/app/mcp_server.py over stdio and streamable HTTP: tools listed, a call,
a call past its time limit, a server that crashes mid-call and one that cannot start, each a clear message."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.mcp import config as mcp_config
from engine.mcp.approvals import Approvals
from engine.mcp.client import McpError, result_text
from engine.mcp.host import McpHost
from engine.mcp.names import MAX_NAME, ToolInfo, exposed_name

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "tests" / "app" / "mcp_server.py"


def stdio_server(name: str = "tests", **env: str) -> mcp_config.ServerConfig:
    return mcp_config.ServerConfig(name, command=sys.executable, args=[str(SERVER)], env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def host():
    h = McpHost()
    yield h
    h.close()


@pytest.fixture(scope="module")
def http_url():
    """tests/app/mcp_server.py over streamable HTTP, in a process of its own on a free port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the HTTP MCP server ended: {proc.stderr.read().decode(errors='replace')}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise TimeoutError("the HTTP MCP server did not listen within 60 s")
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- mcp.json ----------------------------------------------------------------------------------------------------
def test_config_reads_both_kinds_and_writes_them_back_with_other_apps_keys(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "server-fs", "/tmp"], "env": {"DEBUG": "1"}, "autoApprove": []},
        "search": {"type": "http", "url": "http://127.0.0.1:9000/mcp", "headers": {"Authorization": "Bearer x"}},
        "off": {"command": "x", "disabled": True}}}))
    servers = mcp_config.load(path)
    assert list(servers) == ["files", "search", "off"]
    files, search = servers["files"], servers["search"]
    assert (files.transport, files.command, files.args, files.env) == ("stdio", "npx", ["-y", "server-fs", "/tmp"],
                                                                        {"DEBUG": "1"})
    assert (search.transport, search.url, search.headers) == ("http", "http://127.0.0.1:9000/mcp",
                                                               {"Authorization": "Bearer x"})
    assert servers["off"].disabled
    mcp_config.save(path, servers)
    again = json.loads(path.read_text())["mcpServers"]
    assert again["files"]["autoApprove"] == [] and again["off"]["disabled"] is True
    assert mcp_config.load(path)["search"].headers == {"Authorization": "Bearer x"}
    assert mcp_config.load(tmp_path / "none.json") == {}  # no file: no servers


def test_config_names_every_problem_by_server_and_field(tmp_path):
    bad = {"mcpServers": {
        "neither": {"args": []},
        "both": {"command": "x", "url": "http://a"},
        "args": {"command": "x", "args": "--flag"},
        "env": {"command": "x", "env": {"N": 1}},
        "sse": {"type": "sse", "url": "http://a/sse"},
        "url": {"url": "ftp://a"}}}
    with pytest.raises(mcp_config.McpConfigError) as e:
        mcp_config.parse(bad)
    text = str(e.value)
    for piece in ('server "neither" needs "command"', 'server "both" has both "command" and "url"',
                  'server "args": "args" must be a list of strings', 'server "env": "env" must be an object',
                  'server "sse" uses the SSE transport', 'server "url": "url" must start with http://'):
        assert piece in text, (piece, text)
    with pytest.raises(mcp_config.McpConfigError, match="mcpServers"):
        mcp_config.parse({"mcpServers": []})
    path = tmp_path / "mcp.json"
    path.write_text("{not json")
    with pytest.raises(mcp_config.McpConfigError, match="not valid JSON"):
        mcp_config.load(path)
    path.write_text(" " * (mcp_config.MAX_BYTES + 1))
    with pytest.raises(mcp_config.McpConfigError, match="more than an MCP configuration"):
        mcp_config.load(path)


def test_tool_names_for_the_model_are_namespaced_and_within_the_rule():
    assert exposed_name("tests", "add") == "tests__add"
    assert exposed_name("my server", "read.file") == "my_server__read_file"
    long_a, long_b = exposed_name("s" * 40, "t" * 40 + "a"), exposed_name("s" * 40, "t" * 40 + "b")
    assert len(long_a) <= MAX_NAME and long_a != long_b
    assert all(c.isalnum() or c in "_-" for c in long_a)
    tool = ToolInfo("tests", "add", "Adds.", {"type": "object", "properties": {"a": {"type": "integer"}}})
    assert tool.openai_tool()["function"]["name"] == "tests__add"


def test_always_allowed_is_remembered_per_server_and_tool():
    saved = {}
    approvals = Approvals({"a": ["x"]}, lambda data: saved.update(data=data))
    assert approvals.allowed("a", "x") and not approvals.allowed("a", "y") and not approvals.allowed("b", "x")
    approvals.allow_always("b", "x")
    assert saved["data"] == {"a": ["x"], "b": ["x"]}
    approvals.revoke("a")
    assert not approvals.allowed("a", "x") and saved["data"] == {"b": ["x"]}


def test_a_result_that_is_too_long_or_not_text_is_still_text():
    from mcp_types import CallToolResult, ImageContent, TextContent
    big = result_text(CallToolResult(content=[TextContent(type="text", text="x" * 200_000)]))
    assert len(big.text) < 101_000 and "cut" in big.text and not big.error
    image = result_text(CallToolResult(content=[ImageContent(type="image", data="aGVsbG8=", mime_type="image/png")]))
    assert image.text.startswith("[image: image/png")
    assert result_text(object()).error


# ---- sessions over stdio and HTTP ------------------------------------------------------------------------------
other_process = pytest.mark.subprocess  # MCP servers are other processes: a subprocess over stdio, or HTTP


@other_process
def test_stdio_lists_tools_and_calls_one(host):
    tools = asyncio.run(host.list_tools(stdio_server()))
    assert {t.name for t in tools} == {"add", "slow"}
    add = next(t for t in tools if t.name == "add")
    assert add.exposed == "tests__add" and "a" in add.input_schema["properties"]
    result = asyncio.run(host.call(stdio_server(), "add", {"a": 2, "b": 3}, timeout=20))
    assert (result.text, result.error) == ("5", False)


@other_process
def test_http_lists_tools_and_calls_one(host, http_url):
    server = mcp_config.ServerConfig("web", url=http_url, headers={"X-Test": "1"})
    tools = asyncio.run(host.probe(server))
    assert {t.name for t in tools} == {"add", "slow"}
    result = asyncio.run(host.call(server, "add", {"a": 40, "b": 2}, timeout=20))
    assert (result.text, result.error) == ("42", False)


@other_process
def test_a_slow_tool_times_out_and_the_session_goes_on(host):
    t0 = time.monotonic()
    result = asyncio.run(host.call(stdio_server(), "slow", {"seconds": 30}, timeout=0.5))
    assert time.monotonic() - t0 < 10
    assert result.error and "did not run slow within 0.5 s" in result.text and "time limit" in result.text
    assert asyncio.run(host.call(stdio_server(), "add", {"a": 1, "b": 1}, timeout=20)).text == "2"


@other_process
def test_a_server_that_crashes_mid_call_is_reported_with_its_last_words(host):
    crashing = stdio_server("crashy", MCP_TEST_CRASH="1")
    result = asyncio.run(host.call(crashing, "add", {"a": 1, "b": 2}, timeout=20))
    assert result.error and 'The MCP server "crashy" stopped' in result.text
    assert "crashing on purpose" in result.text and "while it was asked to run add" in result.text
    again = asyncio.run(host.call(crashing, "add", {"a": 1, "b": 2}, timeout=20))  # started again, crashes again
    assert again.error and "stopped" in again.text


@other_process
def test_a_server_that_cannot_start_or_be_reached_says_so(host):
    missing = mcp_config.ServerConfig("gone", command="ninfer-no-such-mcp-server")
    with pytest.raises(McpError, match='"gone" could not be started.*was not found'):
        asyncio.run(host.probe(missing))
    result = asyncio.run(host.call(missing, "add", {}, timeout=5))
    assert result.error and "was not found" in result.text
    nowhere = mcp_config.ServerConfig("nowhere", url=f"http://127.0.0.1:{free_port()}/mcp")
    with pytest.raises(McpError, match='"nowhere" at http://127.0.0.1:\\d+/mcp cannot be reached'):
        asyncio.run(host.probe(nowhere))
