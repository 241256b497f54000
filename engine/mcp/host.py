"""The MCP sessions of a process on a thread of their own (Qt-free).

The SDK's transports run on anyio (subprocesses, HTTP streams); they get a plain asyncio loop on a daemon thread,
whatever loop the caller runs (the app's qasync loop, a server's uvicorn loop). Callers ``await`` the host's
methods from their own loop; cancelling such an await (the chat's Stop) cancels the work on the host's loop too.
One session per server name, started on first use, started again when its configuration changed or it ended (a
crashed server is started again at the next call).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine

from engine.mcp.client import LIST_TIMEOUT_S, McpError, McpSession, ToolResult
from engine.mcp.config import ServerConfig
from engine.mcp.names import ToolInfo

CLOSE_TIMEOUT_S = 15.0


class McpHost:
    def __init__(self, connect_timeout: float | None = None):
        self.connect_timeout = connect_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.sessions: dict[str, McpSession] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._started = threading.Lock()
        self.closed = False

    # ---- the thread ------------------------------------------------------------------------------------------------
    def _ensure_thread(self) -> asyncio.AbstractEventLoop:
        with self._started:
            if self.closed:
                raise McpError("The MCP tools were shut down.", "Start the app again.")
            if self.loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self.thread = threading.Thread(target=run, name="ninfer-mcp", daemon=True)
                self.thread.start()
                ready.wait(10)
                self.loop = loop
            return self.loop

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Runs ``coro`` on the host's loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_thread())

    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Awaits ``coro`` on the host's loop from the caller's loop (cancelling this cancels it there)."""
        return await asyncio.wrap_future(self.submit(coro))

    # ---- sessions (these run on the host's loop) ---------------------------------------------------------------------
    async def _session(self, server: ServerConfig) -> McpSession:
        lock = self._locks.setdefault(server.name, asyncio.Lock())
        async with lock:
            session = self.sessions.get(server.name)
            if session is not None and session.alive and session.server.key() == server.key():
                return session
            if session is not None:
                self.sessions.pop(server.name, None)
                await session.close()
            kwargs = {"connect_timeout": self.connect_timeout} if self.connect_timeout else {}
            session = McpSession(server, **kwargs)
            await session.start()  # McpError when it cannot
            self.sessions[server.name] = session
            return session

    async def _list(self, server: ServerConfig, timeout: float) -> list[ToolInfo]:
        return await (await self._session(server)).list_tools(timeout)

    async def _call(self, server: ServerConfig, tool: str, arguments: dict, timeout: float) -> ToolResult:
        try:
            session = await self._session(server)
        except McpError as e:
            return ToolResult(str(e), error=True)
        return await session.call_tool(tool, arguments, timeout)

    async def _probe(self, server: ServerConfig, timeout: float) -> list[ToolInfo]:
        kwargs = {"connect_timeout": self.connect_timeout} if self.connect_timeout else {}
        session = McpSession(server, **kwargs)
        try:
            await session.start()
            return await session.list_tools(timeout)
        finally:
            await session.close()

    async def _close_all(self) -> None:
        sessions, self.sessions = list(self.sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

    # ---- what callers await ----------------------------------------------------------------------------------------
    async def list_tools(self, server: ServerConfig, timeout: float = LIST_TIMEOUT_S) -> list[ToolInfo]:
        """The server's tools (connecting first if needed); McpError says why not."""
        return await self.run(self._list(server, timeout))

    async def call(self, server: ServerConfig, tool: str, arguments: dict, timeout: float) -> ToolResult:
        """Calls a tool; never raises for the server's failures (the result says what happened)."""
        return await self.run(self._call(server, tool, arguments, timeout))

    async def probe(self, server: ServerConfig, timeout: float = LIST_TIMEOUT_S) -> list[ToolInfo]:
        """Test connection: a fresh session of its own lists the tools and ends; McpError says why not."""
        return await self.run(self._probe(server, timeout))

    async def forget(self, name: str) -> None:
        """Ends the session of ``name`` (its configuration was removed)."""
        async def drop() -> None:
            session = self.sessions.pop(name, None)
            if session is not None:
                await session.close()
        if self.loop is not None:
            await self.run(drop())

    def close(self) -> None:
        """Ends every session (their subprocesses too) and the thread; waits at most CLOSE_TIMEOUT_S."""
        with self._started:
            self.closed = True
            loop, self.loop = self.loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_all(), loop).result(CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 (a session that will not end: the process exit takes it)
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self.thread is not None:
            self.thread.join(CLOSE_TIMEOUT_S)
