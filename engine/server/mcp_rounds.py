"""The round loop of server-side MCP tools, shared by the three APIs: the model answers a round; when all it asks
for are calls to the request's MCP tools, they run here, their outputs join the conversation, and the next round
starts; at most MAX_CALLS calls, then one last round without tools. Each API gives a `Conversation` (its own
request, events and call shapes); the loop yields what happened so the API can stream or collect it."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from engine.mcp.names import ToolInfo

MAX_CALLS = 16  # tool calls one request may run; then the model is asked to answer without tools
CALL_TIMEOUT_S = 60.0
OVER_LIMIT = f"Not run: this request reached its limit of {MAX_CALLS} tool calls; answer with what you have."


@dataclass
class Call:
    """One call the model made: its id, the name it used, and its arguments as the JSON text it wrote."""
    id: str
    name: str
    arguments: str


class Conversation(Protocol):
    no_tools: Any  # the tool choice of the last round (no calls)

    def round(self, tool_choice) -> AsyncIterator[str]:
        """Generates one answer: the API's events as it would stream them."""

    def calls(self) -> list[Call]:
        """The calls of the round that just ended (none when it failed)."""

    def add(self, calls: list[Call], done: list[dict]) -> None:
        """Adds the round's calls and what each gave (run_call's dict, or None when not run) to the conversation."""

    def relaxed(self, choice):
        """The tool choice after a round of calls: a forced call is not forced again."""


class StartedRounds:
    """What the Responses and Messages conversations share: the first round is started (`begin`) before the answer
    goes out, so a request the engine refuses gets its status code; later rounds start when they run."""
    reply = pending = None  # a subclass's `begin(tool_choice)` sets `pending` to its API's started reply

    async def round(self, tool_choice):
        if self.pending is None:
            await self.begin(tool_choice)
        self.reply, self.pending = self.pending, None
        async for event in self.reply.sse():
            yield event


def relaxed(choice):
    """The tool choice after a round of calls: a forced call is not forced again."""
    return "auto" if choice == "required" or isinstance(choice, dict) else choice


async def run_call(state, tool: ToolInfo, call: Call) -> dict[str, Any]:
    """Runs one call of the model's: what ran, with the text the model reads next."""
    st = state.mcp
    started = time.monotonic()
    try:
        arguments = json.loads(call.arguments or "{}")
        if not isinstance(arguments, dict):
            raise ValueError("not an object")
    except ValueError:
        text, error, arguments = f"The arguments are not a JSON object: {call.arguments[:200]}", True, call.arguments
    else:
        result = await st.host.call(st.servers[tool.server], tool.name, arguments, CALL_TIMEOUT_S)
        text, error = result.text, result.error
    return {"id": call.id, "server_label": tool.server, "name": tool.name, "arguments": arguments,
            "arguments_text": call.arguments or "{}", "output": text, "error": error,
            "seconds": round(time.monotonic() - started, 3)}


def public(done: dict) -> dict:
    """A call as chat's `mcp_calls` lists it."""
    return {k: v for k, v in done.items() if k != "arguments_text"}


async def rounds(convo: Conversation, state, named: dict[str, ToolInfo], choice) -> AsyncIterator[tuple[str, Any]]:
    """("event", the API's event text) for each event of each round, ("ran", run_call's dict) after each call
    that ran, and last ("final", the calls that ran)."""
    ran: list[dict] = []
    while True:
        last = len(ran) >= MAX_CALLS
        async for event in convo.round(convo.no_tools if last else choice):
            yield "event", event
        calls = convo.calls()
        if last or not calls or any(c.name not in named for c in calls):
            yield "final", ran
            return
        done: list[dict | None] = []
        for call in calls:
            if len(ran) < MAX_CALLS:
                ran.append(await run_call(state, named[call.name], call))
                done.append(ran[-1])
                yield "ran", ran[-1]
            else:
                done.append(None)
        convo.add(calls, done)
        choice = convo.relaxed(choice)


def sse_parts(event: str) -> tuple[str, dict] | None:
    """(kind, body) of an `event: KIND / data: JSON` server-sent event (None for a bare `data:` line)."""
    head, _, data = event.partition("\n")
    if not head.startswith("event: "):
        return None
    return head[len("event: "):], json.loads(data.removeprefix("data: "))
