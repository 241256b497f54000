"""The answer of POST /v1/responses: a `response` object, or its server-sent events. Items are streamed one after
another (the one in progress is done before the next starts): reasoning (`response.reasoning_text.delta/done`, or,
when the request asks for a reasoning summary, the reasoning as its summary: `response.reasoning_summary_part.added`,
`response.reasoning_summary_text.delta/done`, `response.reasoning_summary_part.done`),
a message (`response.content_part.added`, `response.output_text.delta/done`, `response.content_part.done`), and
one item per tool call: `function_call` (`response.function_call_arguments.delta/done`), `custom_tool_call`
(`response.custom_tool_call_input.delta/done`) or `local_shell_call`, each between
`response.output_item.added` and `response.output_item.done`. The stream ends with `response.completed`,
`response.incomplete` (the token budget ran out) or `response.failed`."""
from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing

from engine.server.errors import APIError
from engine.server.generation import Choice, Event, run_choices
from engine.server.responses_input import ResponseTools

_ITEM_PREFIX = {"function_call": "fc", "custom_tool_call": "ctc", "local_shell_call": "lsh"}


class _InputText:
    """A custom tool's input read out of its streamed arguments when they begin with it: the pieces after
    `{"input": "` are JSON string text, each holding whole escapes (engine.server.argstream), decoded as they
    come until the string's closing quote."""
    PREFIX = '{"input": "'

    def __init__(self):
        self.head = ""
        self.streaming = False
        self.closed = False
        self.streamed = ""

    def feed(self, piece: str) -> str:
        if self.closed:
            return ""
        if not self.streaming:
            self.head += piece
            if not self.head.startswith(self.PREFIX[:len(self.head)]):
                self.closed = True  # the arguments begin otherwise: the input comes whole at the end
                return ""
            if len(self.head) < len(self.PREFIX):
                return ""
            self.streaming, piece = True, self.head[len(self.PREFIX):]
        i, out = 0, []
        while i < len(piece):
            if piece[i] == '"':
                self.closed = True
                break
            step = 6 if piece.startswith("\\u", i) else 2 if piece[i] == "\\" else 1
            out.append(piece[i:i + step])
            i += step
        text = json.loads('"' + "".join(out) + '"') if out else ""
        self.streamed += text
        return text


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseReply:
    def __init__(self, req, streams, choice: Choice, prompt_tokens: int, tools: ResponseTools):
        self.req, self.streams, self.choice, self.tools = req, streams, choice, tools
        self.id = new_id("resp")
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.usage = {"completion_tokens": {0: 0}, "cached_tokens": {0: 0}}
        self.output: list[dict] = []
        self.status, self.incomplete = "in_progress", None
        self.failed: Event | None = None  # why the response failed (an engine error, or the server cut it)
        self.seq = 0
        self._open: dict | None = None  # the reasoning or message item being streamed
        self._calls: dict[int, dict] = {}  # call index -> its call_id, name and (function calls) output item
        # reasoning.summary asked for: the model's reasoning is given as the summary (what Codex shows by default)
        self.as_summary = req.reasoning is not None and req.reasoning.summary not in (None, "none")

    def _error(self) -> dict | None:
        return None if self.failed is None else {"code": self.failed.error_code, "message": self.failed.error}

    def response(self) -> dict:
        out_tokens, cached = self.usage["completion_tokens"][0], self.usage["cached_tokens"][0]
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "model": req.model, "output": self.output, "error": self._error(), "incomplete_details": self.incomplete,
            "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "text": req.text or {"format": {"type": "text"}}, "store": False,
            "omitted_tools": self.tools.omitted,
            "usage": {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached,
                                                                               "cache_write_tokens": 0},
                      "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.prompt_tokens + out_tokens},
        }

    def _event(self, kind: str, **body) -> str:
        body = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _add(self, item: dict):
        self.output.append(item)
        yield self._event("response.output_item.added", output_index=len(self.output) - 1, item=json.loads(
            json.dumps(item)))

    def _done(self, item: dict):
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=self.output.index(item), item=item)

    def _close(self):
        item, self._open = self._open, None
        if item is None:
            return
        idx = self.output.index(item)
        if item["type"] == "reasoning" and self.as_summary:
            part = item["summary"][0]
            yield self._event("response.reasoning_summary_text.done", item_id=item["id"], output_index=idx,
                              summary_index=0, text=part["text"])
            yield self._event("response.reasoning_summary_part.done", item_id=item["id"], output_index=idx,
                              summary_index=0, part=part)
        elif item["type"] == "reasoning":
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                              text=item["content"][0]["text"])
        else:
            part = item["content"][0]
            yield self._event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                              text=part["text"])
            yield self._event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                              part=part)
        yield from self._done(item)

    def _text(self, kind: str, text: str):
        item = self._open
        if item is None or item["type"] != kind:
            yield from self._close()
            if kind == "reasoning" and self.as_summary:
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress"}
                yield from self._add(item)
                part = {"type": "summary_text", "text": ""}
                item["summary"].append(part)
                yield self._event("response.reasoning_summary_part.added", item_id=item["id"],
                                  output_index=len(self.output) - 1, summary_index=0, part=dict(part))
            elif kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
                yield from self._add(item)
            else:
                item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": []}
                yield from self._add(item)
                part = {"type": "output_text", "text": "", "annotations": []}
                item["content"].append(part)
                yield self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output)
                                  - 1, content_index=0, part=dict(part))
            self._open = item
        if kind == "reasoning" and self.as_summary:
            item["summary"][0]["text"] += text
            yield self._event("response.reasoning_summary_text.delta", item_id=item["id"],
                              output_index=len(self.output) - 1, summary_index=0, delta=text)
            return
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        yield self._event(name, item_id=item["id"], output_index=len(self.output) - 1, content_index=0, delta=text)

    def _call(self, event):
        """A call's events: a function call's arguments stream as `response.function_call_arguments.delta` and a
        custom call's input as `response.custom_tool_call_input.delta` while they are generated (the input when the
        arguments begin with it, else in one piece at the end); a shell call is given whole once it ends."""
        if event[0] == "tool_call":
            _, index, call_id, name, arguments = event
            yield from self._close()
            item = self.tools.output_item(call_id, name, "", "")
            self._calls[index] = {"call_id": call_id, "name": name, "item": None, "input": _InputText()}
            if item["type"] == "local_shell_call":
                return
            item.update(id=new_id(_ITEM_PREFIX[item["type"]]), status="in_progress")
            self.output.append(item)
            self._calls[index]["item"] = item
            yield self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))
            event = ("tool_args", index, arguments)
        call = self._calls[event[1]]
        item = call["item"]
        if item is None:
            if event[0] == "tool_end":
                yield from self._shell_call(call["call_id"], call["name"], event[2])
            return
        at = self.output.index(item)
        if item["type"] == "function_call":
            if event[0] == "tool_args" and event[2]:
                yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                  delta=event[2])
            elif event[0] == "tool_end":
                item["arguments"] = event[2]
                yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                  arguments=event[2])
                yield from self._done(item)
            return
        text = call["input"]
        if event[0] == "tool_args":
            delta = text.feed(event[2])
        elif text.streaming:  # the input streamed is the input, also where the arguments go on after it
            item["input"], delta = text.streamed, ""
        else:
            item["input"] = delta = self.tools.output_item(call["call_id"], call["name"], event[2], "")["input"]
        if delta:
            yield self._event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=at,
                              delta=delta)
        if event[0] == "tool_end":
            yield self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=at,
                              input=item["input"])
            yield from self._done(item)

    def _shell_call(self, call_id: str, name: str, arguments: str):
        done = self.tools.output_item(call_id, name, arguments, "")
        done["id"] = new_id(_ITEM_PREFIX[done["type"]])
        self.output.append(done)
        yield self._event("response.output_item.added", output_index=len(self.output) - 1,
                          item={**done, "status": "in_progress"})
        yield from self._done(done)

    async def sse(self):
        yield self._event("response.created", response=self.response())
        yield self._event("response.in_progress", response=self.response())
        async with aclosing(run_choices(self.streams, [self.choice], self.usage)) as events:
            async for ev in events:
                if ev.error:
                    self.status, self.failed = "failed", ev
                    yield self._event("error", code=ev.error_code, message=ev.error, param=None)
                    break
                for kind, text in (("reasoning", ev.reasoning), ("message", ev.content)):
                    if text:
                        for chunk in self._text(kind, text):
                            yield chunk
                for event in ev.tool_calls:
                    for chunk in self._call(event):
                        yield chunk
                if ev.finish:
                    self.status = "incomplete" if ev.finish == "length" else "completed"
                    self.incomplete = {"reason": "max_output_tokens"} if ev.finish == "length" else None
        for chunk in self._close():
            yield chunk
        if self.status == "failed":
            yield self._event("response.failed", response=self.response())
        else:
            self.status = "completed" if self.status == "in_progress" else self.status
            yield self._event("response.completed" if self.status == "completed" else "response.incomplete",
                              response=self.response())

    async def whole(self) -> dict:
        async for _ in self.sse():
            pass
        if self.status == "failed":
            if self.failed is not None and self.failed.error_status != 500:
                raise APIError(self.failed.error_status, self.failed.error, code=self.failed.error_code)
            raise APIError(500, "The engine failed while generating the response.", code="engine_error")
        return self.response()
