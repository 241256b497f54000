"""The answer of POST /v1/messages: content blocks (thinking, text, tool_use) in one message object, or streamed as
Anthropic's server-sent events: message_start, ping, content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop per block, message_delta (stop_reason, usage),
message_stop; an engine failure mid-stream is an `error` event."""
from __future__ import annotations

import json
import uuid
from contextlib import aclosing

from engine.server.errors import APIError, anthropic_error_body
from engine.server.generation import Choice, Event, run_choices

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def sse_event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class MessageReply:
    def __init__(self, model: str, streams, choice: Choice, prompt_tokens: int, hide_thinking: bool = False):
        self.model, self.streams, self.choice = model, streams, choice
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.prompt_tokens = prompt_tokens
        self.hide_thinking = hide_thinking
        self.usage = {"completion_tokens": {0: 0}, "cached_tokens": {0: 0}}
        self.content: list[dict] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.failed: Event | None = None
        self._open: str | None = None  # the kind of the block being streamed ("thinking", "text" or "tool_use")

    def usage_body(self) -> dict:
        cached = self.usage["cached_tokens"][0]
        return {"input_tokens": self.prompt_tokens - cached, "output_tokens": self.usage["completion_tokens"][0],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage_body()}

    # --- blocks ---
    def _close(self):
        if self._open is None:
            return
        self._open = None
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})

    def _start(self, block: dict):
        self.content.append(block)
        yield sse_event("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                                "content_block": dict(block)})

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                 "delta": delta})

    def _text(self, kind: str, text: str):
        """Text or thinking: appended to the open block of that kind, or a new block."""
        if self._open != kind:
            yield from self._close()
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""})
            self._open = kind
        if kind == "thinking":
            if self.hide_thinking:  # thinking.display "omitted": the block is there, its text is not
                return
            self.content[-1]["thinking"] += text
            yield self._delta({"type": "thinking_delta", "thinking": text})
        else:
            self.content[-1]["text"] += text
            yield self._delta({"type": "text_delta", "text": text})

    def _tool_use(self, event):
        """A tool_use block: started when the call begins, its input streamed as input_json_delta pieces (they
        concatenate to the input's JSON), stopped when the call ends."""
        if event[0] == "tool_call":
            _, _, call_id, name, arguments = event
            yield from self._close()
            block_id = "toolu_" + (call_id[5:] if call_id.startswith("call_") else call_id)
            yield from self._start({"type": "tool_use", "id": block_id, "name": name, "input": {}})
            self._open = "tool_use"
        else:
            arguments = event[2]
        if event[0] == "tool_end":
            self.content[-1]["input"] = json.loads(arguments or "{}")
            yield from self._close()
        elif arguments:
            yield self._delta({"type": "input_json_delta", "partial_json": arguments})

    def _finish(self, finish: str) -> None:
        hit = self.choice.text.stops.hit
        if finish == "stop" and hit is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", hit
        else:
            self.stop_reason = _STOP_REASONS.get(finish, "end_turn")

    # --- the stream ---
    async def sse(self):
        start = {**self.message(), "content": [], "usage": {**self.usage_body(), "output_tokens": 0}}
        yield sse_event("message_start", {"type": "message_start", "message": start})
        yield sse_event("ping", {"type": "ping"})
        async with aclosing(run_choices(self.streams, [self.choice], self.usage)) as events:
            async for ev in events:
                if ev.error:
                    self.failed = ev
                    yield sse_event("error", anthropic_error_body(ev.error_status, _failure(ev)))
                    return
                if ev.reasoning:
                    for chunk in self._text("thinking", ev.reasoning):
                        yield chunk
                if ev.content:
                    for chunk in self._text("text", ev.content):
                        yield chunk
                for event in ev.tool_calls:
                    for chunk in self._tool_use(event):
                        yield chunk
                if ev.finish:
                    self._finish(ev.finish)
        for chunk in self._close():
            yield chunk
        yield sse_event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": self.stop_reason or "end_turn",
                                                    "stop_sequence": self.stop_sequence},
                                          "usage": self.usage_body()})
        yield sse_event("message_stop", {"type": "message_stop"})

    async def whole(self) -> dict:
        async for _ in self.sse():
            pass
        if self.failed:
            raise APIError(self.failed.error_status, _failure(self.failed), code=self.failed.error_code)
        self.stop_reason = self.stop_reason or "end_turn"
        return self.message()


def _failure(ev: Event) -> str:
    """What a client is told of a request that ended in an error (a cut request's message says it all)."""
    return ev.error if ev.error_status != 500 else f"The engine failed while generating the answer: {ev.error}"
