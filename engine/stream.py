"""The handle a caller gets for a submitted request: iterate it (sync or async) for outputs, or abort it."""
from __future__ import annotations

import asyncio
import queue
from typing import Callable

from engine.sequence import RequestOutput


class RequestStream:
    """Outputs are pushed from the engine thread; a sync consumer blocks on a queue, an async one awaits an
    asyncio queue fed with call_soon_threadsafe, so the event loop never blocks."""

    def __init__(self, request_id: str, abort: Callable[[str], None], loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self._sync: queue.Queue[RequestOutput] | None = None if loop else queue.Queue()
        self._async: asyncio.Queue[RequestOutput] | None = asyncio.Queue() if loop else None
        self.finished = False

    def push(self, out: RequestOutput) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, out)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        else:
            self._sync.put(out)

    def abort(self) -> None:
        self._abort(self.request_id)

    def get(self, timeout: float | None = None) -> RequestOutput:
        out = self._sync.get(timeout=timeout)
        self.finished = out.finished
        return out

    def __iter__(self):
        while not self.finished:
            yield self.get()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._async.get()
        self.finished = out.finished
        return out
