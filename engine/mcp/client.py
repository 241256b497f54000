"""One MCP server's session on the official SDK (``mcp.Client``), Qt-free.

A session is one asyncio task that enters the SDK's client (a subprocess over stdio, or streamable HTTP) and holds
it open until ``close()``: the SDK's transports must be entered and left by the same task. Other tasks list the
server's tools and call them through it. Nothing here raises at a caller for a server's failure: a server that
cannot start, crashes, answers too late or answers nonsense becomes a ``ToolResult`` with ``error`` set and a
message that names the server, what happened and what to do (or, for connecting and listing, an ``McpError``
with that message).
"""
from __future__ import annotations

import asyncio
import json
import tempfile
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from engine.errors import NInferError
from engine.mcp.config import ServerConfig
from engine.mcp.names import ToolInfo

CONNECT_TIMEOUT_S = 30.0
LIST_TIMEOUT_S = 20.0
MAX_RESULT_CHARS = 100_000  # a longer result is cut (the model's context is the limit, not the server's output)
MAX_TOOL_PAGES = 20
STDERR_TAIL = 400  # characters of a stdio server's stderr quoted when it stops


class McpError(NInferError):
    """A server that could not be reached or listed; the message says which and what to do."""


@dataclass
class ToolResult:
    text: str
    error: bool = False  # the call failed: the text says why (it is still what the model is told)
    seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "error": self.error, "seconds": self.seconds}


def _leaf(e: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups, the way anyio task groups raise them."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def block_text(block: Any) -> str:
    """One content block of a result as text: text as it is, anything else named."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return getattr(block, "text", "") or ""
    if kind in ("image", "audio"):
        size = len(getattr(block, "data", "") or "") * 3 // 4
        return f"[{kind}: {getattr(block, 'mime_type', None) or getattr(block, 'mimeType', '?')}, {size:,} bytes]"
    if kind == "resource":
        res = getattr(block, "resource", None)
        text = getattr(res, "text", None)
        return text if isinstance(text, str) else f"[resource {getattr(res, 'uri', '?')}]"
    if kind == "resource_link":
        return f"[resource link {getattr(block, 'uri', '?')}]"
    return f"[{kind or type(block).__name__} content]"


def result_text(result: Any) -> ToolResult:
    """An SDK ``CallToolResult`` as the text the model reads (cut at MAX_RESULT_CHARS)."""
    content = getattr(result, "content", None)
    if not isinstance(content, list):
        return ToolResult("The server answered with a result that is not an MCP tool result.", error=True)
    text = "\n".join(block_text(b) for b in content)
    structured = getattr(result, "structured_content", None)
    if not text.strip() and structured is not None:
        text = json.dumps(structured, ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n… (cut: the result has {len(text):,} characters)"
    return ToolResult(text, error=bool(getattr(result, "is_error", False)))


class McpSession:
    """One server's connection. ``await start()``, then ``list_tools()`` / ``call_tool()``, then ``await close()``.
    ``alive`` is False once it ended (``ended`` says why)."""

    def __init__(self, server: ServerConfig, connect_timeout: float = CONNECT_TIMEOUT_S):
        self.server = server
        self.connect_timeout = connect_timeout
        self.client: Any = None
        self.ended: str | None = None
        self._task: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") \
            if server.transport == "stdio" else None

    @property
    def alive(self) -> bool:
        return self.client is not None and self.ended is None and self._task is not None and not self._task.done()

    # ---- the session's own task --------------------------------------------------------------------------------
    async def _transport(self, stack: AsyncExitStack):
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        s = self.server
        if s.transport == "stdio":
            params = StdioServerParameters(command=s.command, args=list(s.args), env=dict(s.env) or None, cwd=s.cwd)
            return stdio_client(params, errlog=self._stderr)
        http = await stack.enter_async_context(create_mcp_http_client(headers=dict(s.headers) or None))
        return streamable_http_client(s.url, http_client=http)

    async def _run(self) -> None:
        from mcp import Client, Implementation

        try:
            async with AsyncExitStack() as stack:
                transport = await self._transport(stack)
                client = Client(transport, client_info=Implementation(name="ninfer", version="1"))
                self.client = await stack.enter_async_context(client)
                self._ready.set()
                await self._closing.wait()
        except asyncio.CancelledError:
            self.ended = self.ended or "closed"
            raise
        except BaseException as e:  # noqa: BLE001 (anyio raises exception groups; each is reported)
            self.ended = self.describe_failure(_leaf(e))
        finally:
            self.client = None
            if self.ended is None:
                self.ended = "closed" if self._closing.is_set() else self.stopped_text()

    # ---- what went wrong, in words -------------------------------------------------------------------------------
    def stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.flush()
            self._stderr.seek(0)
            text = self._stderr.read()
        except (OSError, ValueError):
            return ""
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return "\n".join(lines[-6:])[-STDERR_TAIL:]

    def stopped_text(self) -> str:
        tail = self.stderr_tail()
        return f"the MCP server \"{self.server.name}\" stopped" + (f" (its last output: {tail})" if tail else "")

    def describe_failure(self, e: BaseException) -> str:
        s = self.server
        if isinstance(e, FileNotFoundError):
            return (f"the MCP server \"{s.name}\" could not be started: {s.command!r} was not found. Install it or "
                    f"give its full path as \"command\" in mcp.json")
        if isinstance(e, OSError) and s.transport == "stdio":
            return f"the MCP server \"{s.name}\" could not be started ({e.strerror or e}). Check its \"command\""
        name = type(e).__name__
        if s.transport == "http" and ("Connect" in name or "Timeout" in name or isinstance(e, OSError)):
            return (f"the MCP server \"{s.name}\" at {s.url} cannot be reached ({name}: {e or 'no answer'}). Is it "
                    f"running, and is the URL right?")
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status is not None:
            hint = " Check its \"headers\" (a token?)" if status in (401, 403) else " Check the URL"
            return f"the MCP server \"{s.name}\" answered HTTP {status}.{hint}"
        code = getattr(e, "code", None)
        from mcp_types import CONNECTION_CLOSED
        if code == CONNECTION_CLOSED:
            return self.stopped_text()
        return f"the MCP server \"{s.name}\" failed: {name}: {e}" + (
            f" (its last output: {self.stderr_tail()})" if self.stderr_tail() else "")

    # ---- what callers use ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connects (starts the subprocess, or reaches the URL) and completes MCP's handshake; McpError if not."""
        self._ready, self._closing = asyncio.Event(), asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"mcp-session-{self.server.name}")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait({self._task, ready}, timeout=self.connect_timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if self._ready.is_set() and not self._task.done():
            return
        if not self._task.done():
            self.ended = (f"the MCP server \"{self.server.name}\" did not complete MCP's handshake within "
                          f"{self.connect_timeout:g} s. Check that it speaks MCP on "
                          f"{'stdin/stdout' if self.server.transport == 'stdio' else 'this URL'}")
            await self.close()
        raise McpError(_sentence(self.ended or self.stopped_text()))

    async def close(self) -> None:
        if self._closing is not None:
            self._closing.set()
        task = self._task
        if task is not None and not task.done():
            if not (self._ready is not None and self._ready.is_set()):
                task.cancel()  # still connecting: nothing to close politely
            await asyncio.wait({task}, timeout=10)  # the SDK ends a subprocess within a few seconds
            if not task.done():
                task.cancel()
        if self._stderr is not None:
            try:
                self._stderr.close()
            except OSError:
                pass

    async def list_tools(self, timeout: float = LIST_TIMEOUT_S) -> list[ToolInfo]:
        """Every tool of the server (all pages); McpError when it cannot be listed."""
        async def every_page() -> list[ToolInfo]:
            tools, cursor = [], None
            for _ in range(MAX_TOOL_PAGES):
                page = await self.client.list_tools(cursor=cursor)
                tools += [ToolInfo(self.server.name, t.name, t.description or "", dict(t.input_schema or {}))
                          for t in page.tools]
                cursor = page.next_cursor
                if not cursor:
                    break
            return tools

        if not self.alive:
            raise McpError(_sentence(self.ended or "the session is not started"))
        outcome = await self._race(every_page(), timeout)
        if isinstance(outcome, str):
            raise McpError(_sentence(outcome.replace("{what}", "list its tools")))
        return outcome

    async def call_tool(self, tool: str, arguments: dict[str, Any], timeout: float) -> ToolResult:
        """Calls ``tool``; whatever happens, a ToolResult (``error`` set when it failed, with the reason)."""
        if not self.alive:
            return ToolResult(_sentence(self.ended or "the session is not started"), error=True)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outcome = await self._race(self.client.call_tool(tool, arguments), timeout)
        seconds = loop.time() - t0
        if isinstance(outcome, str):
            return ToolResult(_sentence(outcome.replace("{what}", f"run {tool}")), error=True, seconds=seconds)
        result = result_text(outcome)
        result.seconds = seconds
        return result

    async def _race(self, coro, timeout: float):
        """The result of ``coro``, or a message (with ``{what}`` for the caller's words) when it failed, timed out
        or the session ended first."""
        from pydantic import ValidationError

        call = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({call, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                try:
                    return call.result()
                except ValidationError as e:
                    return (f"the MCP server \"{self.server.name}\" answered with a result that is not valid MCP "
                            f"({e.error_count()} problem(s), first: {e.errors()[0].get('msg', '')})")
                except Exception as e:  # noqa: BLE001 (an MCPError from the server, a closed connection, ...)
                    return self._call_failure(e)
            if self._task.done():
                return f"{self.ended or self.stopped_text()} while it was asked to {{what}}"
            return (f"the MCP server \"{self.server.name}\" did not {{what}} within {timeout:g} s (the call was "
                    f"cancelled). Raise the time limit in MCP servers… if the tool needs longer")
        finally:
            if not call.done():
                call.cancel()

    def _call_failure(self, e: Exception) -> str:
        from mcp_types import CONNECTION_CLOSED

        code = getattr(e, "code", None)
        if code == CONNECTION_CLOSED:
            self.ended = self.ended or self.stopped_text()
            return f"{self.stopped_text()} while it was asked to {{what}}"
        message = getattr(e, "message", None) or str(e) or type(e).__name__
        return f"the MCP server \"{self.server.name}\" refused to {{what}}: {message}"


def _sentence(text: str) -> str:
    text = text.strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith(("?", "!", ".")) else text + "."
