"""A tiny MCP server on the official SDK (mcp 2.x: ``MCPServer``, what the 1.x SDK called FastMCP) for the tests of
the chat's tools and of engine/mcp: ``add(a, b)`` and ``slow(seconds)``.

    python tests/app/mcp_server.py                   stdio (the chat starts it as a subprocess)
    python tests/app/mcp_server.py --http PORT       streamable HTTP on http://127.0.0.1:PORT/mcp

With ``MCP_TEST_CRASH=1`` in its environment the process dies (exit code 3, a line on stderr) when a tool is
called: a server crashing mid-call.
"""
from __future__ import annotations

import os
import sys

import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("ninfer-tests", log_level="WARNING")


def _maybe_crash() -> None:
    if os.environ.get("MCP_TEST_CRASH") == "1":
        print("mcp_server: crashing on purpose (MCP_TEST_CRASH=1)", file=sys.stderr, flush=True)
        os._exit(3)


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    _maybe_crash()
    return a + b


@server.tool()
async def slow(seconds: float) -> str:
    """Sleeps for the given number of seconds, then says so."""
    _maybe_crash()
    await anyio.sleep(seconds)
    return f"slept {seconds:g} s"


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(argv[1]))
    else:
        server.run()


if __name__ == "__main__":
    main(sys.argv[1:])
