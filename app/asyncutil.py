"""Running coroutines from Qt slots on the qasync loop, without ever blocking the GUI thread."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

log = logging.getLogger("ninfer.app")
_tasks: set[asyncio.Task] = set()  # strong references, so a running task is never garbage collected


def spawn(coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
    """Schedules ``coro`` on the running (qasync) loop; an exception is logged, never lost."""
    loop = asyncio.get_event_loop()
    task = loop.create_task(coro, name=name)
    _tasks.add(task)

    def done(t: asyncio.Task) -> None:
        _tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("background task %s failed", t.get_name(), exc_info=t.exception())

    task.add_done_callback(done)
    return task


def pending() -> int:
    return len(_tasks)
