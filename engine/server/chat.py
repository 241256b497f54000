"""POST /v1/chat/completions: render the chat, submit n sequences, answer in one body or as SSE chunks."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from engine.constrain import Constraint, UnsupportedSchema, tool_call_constraint
from engine.errors import NInferError
from engine.server.errors import APIError, error_body
from engine.server.generation import (Choice, check_prompt_chars, response_constraint, run_choices, sampling_params,
                                       submit, unless_disconnected, usage_dict)
from engine.server.images import ReadImage, place_images, take_images
from engine.server.parsers import offered_tools, required_tool, validate_tools
from engine.server.schemas import ChatCompletionRequest
from engine.server.state import ServerState
from engine.server.thinking import drop_earlier_thinking, preserve_kwargs, thinking_constraint

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(body) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def tool_call_delta(event) -> dict:
    """A streamed call's chunk: id, type and name once with the first arguments, then more arguments."""
    if event[0] == "tool_call":
        _, index, call_id, name, arguments = event
        return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"index": event[1], "function": {"arguments": event[2]}}


def logprob_entries(tokenizer, logprobs) -> list[dict]:
    def item(tid, value):
        text = tokenizer.token_text(tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
    return [dict(item(lp.token_id, lp.logprob), top_logprobs=[item(t, v) for t, v in lp.top]) for lp in logprobs]


def _thinking_kwargs(state: ServerState, req: ChatCompletionRequest, template: str) -> dict:
    effort = req.reasoning_effort or state.settings.default_reasoning_effort
    if effort == "auto" or "enable_thinking" not in template:
        return {}
    return {"enable_thinking": effort != "none"}


def render_text(state: ServerState, req: ChatCompletionRequest, param: str = "messages") -> str:
    """The prompt text the chat template makes of the request (what POST /apply-template answers), the thinking of
    earlier turns kept or dropped per --reasoning-preserve, each image as the template renders one. CPU-bound:
    call it in a worker thread."""
    return _render_with_images(state, req, param)[0]


def _render_with_images(state: ServerState, req: ChatCompletionRequest, param: str) -> tuple[str, list[ReadImage]]:
    tok = state.ready().tokenizer
    problems = validate_tools(req.tools, req.tool_choice)
    if problems:
        raise APIError(400, "Invalid tools: " + "; ".join(problems) + ".", param="tools")
    messages, images = take_images(state, [m.model_dump(exclude_none=True) for m in req.messages])
    preserve = state.settings.reasoning_preserve
    if preserve == "off":
        messages = drop_earlier_thinking(messages)
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    template = tok.chat_template or ""
    try:
        text = tok.render_chat(messages, tools=tools, add_generation_prompt=True,
                               **_thinking_kwargs(state, req, template), **preserve_kwargs(preserve, template))
    except NInferError as e:
        raise APIError(400, str(e), param="messages") from None
    check_prompt_chars(tok, text, state.ready().context_window, param)
    return text, images


def render(state: ServerState, req: ChatCompletionRequest,
           param: str = "messages") -> tuple[list[int], bool, list[bytes] | None]:
    """Token ids of the prompt (each image's placeholder repeated to its token count), whether the model's answer
    starts inside a <think> block, and the images for Engine.submit (None: none). CPU-bound (a long conversation
    takes seconds to render and encode; an image to decode, or to download): call it in a worker thread."""
    text, images = _render_with_images(state, req, param)
    ids = place_images(state, state.ready().tokenizer.encode(text), images, param)
    return ids, text.rstrip().endswith("<think>"), [i.data for i in images] or None


def parallel_calls(req: ChatCompletionRequest) -> bool:
    """False when the request allows one tool call at most (parallel_tool_calls false; Anthropic's
    disable_parallel_tool_use): the grammar of a forced call admits one, and the parser keeps only the first."""
    return (req.model_extra or {}).get("parallel_tool_calls") is not False


def output_constraint(tok, req: ChatCompletionRequest, in_reasoning: bool) -> Constraint | None:
    """The grammar the answer must follow: a tool call when tool_choice forces one, else the response_format's.
    When the answer starts inside a <think> block, the grammar applies from the token after </think>."""
    forced = required_tool(req.tool_choice) if req.tools else None
    fmt = req.response_format if req.response_format is not None and req.response_format.type != "text" else None
    if forced is None and fmt is None:
        return None
    start_after = None
    if in_reasoning:
        start_after = tok.token_to_id("</think>")
        if start_after is None:
            raise APIError(400, "This model starts its answer with reasoning whose end (</think>) is not one token, "
                                "so structured output cannot be enforced after it.",
                           param="tool_choice" if forced is not None else "response_format")
    if forced is not None:
        try:
            return tool_call_constraint(tok, req.tools, forced, parallel=parallel_calls(req),
                                        start_after=start_after)
        except UnsupportedSchema as e:
            raise APIError(400, str(e), param="tools") from None
    return response_constraint(tok, fmt, start_after)


async def chat_completions(req: ChatCompletionRequest, state: ServerState, request=None):
    reply = await prepare_reply(req, state)
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await unless_disconnected(request, reply.whole()))


async def prepare_reply(req: ChatCompletionRequest, state: ServerState) -> _Reply:
    """The request's sequences submitted to the engine, with what answers them (as one body or as SSE chunks)."""
    state.check_model(req.model)
    loaded = state.ready()
    prompt, in_reasoning, images = await asyncio.to_thread(render, state, req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, state, len(prompt), loaded.context_window, logprobs)
    params.constraint = await asyncio.to_thread(output_constraint, loaded.tokenizer, req, in_reasoning)
    params.constraint = thinking_constraint(state, loaded.tokenizer, req.reasoning_effort, params.max_tokens,
                                            in_reasoning, params.constraint)
    reasoning = "<think>" in (loaded.tokenizer.chat_template or "")
    names = offered_tools(req.tools, req.tool_choice)
    choices = [Choice(i, loaded.tokenizer, req.stop_list(), reasoning=reasoning, starts_in_reasoning=in_reasoning,
                      tool_names=names, parallel_calls=parallel_calls(req)) for i in range(req.n)]
    # last: nothing after it can fail and leave them running
    streams = submit(state, prompt, params, req.n, images=images)
    return _Reply(req, loaded.tokenizer, streams, choices, len(prompt))


class _Reply:
    def __init__(self, req: ChatCompletionRequest, tokenizer, streams, choices, prompt_tokens: int):
        self.req, self.tokenizer, self.streams, self.choices = req, tokenizer, streams, choices
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion = {c.index: 0 for c in choices}
        self.cached = {c.index: 0 for c in choices}  # prompt tokens each choice's sequence reused from the cache
        self.speculation: dict[int, tuple[int, int]] = {}  # choice -> (drafted, accepted) when speculating

    @property
    def usage(self) -> dict:
        return usage_dict(self.prompt_tokens, self.completion, self.speculation, self.cached, len(self.choices))

    def events(self):
        usage = {"completion_tokens": self.completion, "cached_tokens": self.cached, "speculation": self.speculation}
        return run_choices(self.streams, self.choices, usage)

    async def whole(self) -> dict:
        msgs = {c.index: {"content": [], "reasoning": [], "tool_calls": [], "calls": {}, "logprobs": [],
                    "finish": "stop"}
                for c in self.choices}
        async with aclosing(self.events()) as events:
            async for ev in events:
                if ev.error:
                    raise APIError(ev.error_status, ev.error, code=ev.error_code)
                m = msgs[ev.index]
                m["content"].append(ev.content)
                m["reasoning"].append(ev.reasoning)
                for e in ev.tool_calls:
                    if e[0] == "tool_call":
                        m["calls"][e[1]] = {"id": e[2], "type": "function", "function": {"name": e[3]}}
                    elif e[0] == "tool_end":  # the whole arguments: what the pieces streamed concatenate to
                        m["calls"][e[1]]["function"]["arguments"] = e[2]
                        m["tool_calls"].append(m["calls"][e[1]])
                m["logprobs"].extend(ev.logprobs)
                m["finish"] = ev.finish or m["finish"]
        choices = []
        for i, m in msgs.items():
            content = "".join(m["content"])
            message = {"role": "assistant", "content": content if content or not m["tool_calls"] else None}
            reasoning = "".join(m["reasoning"])
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            if m["tool_calls"]:
                message["tool_calls"] = m["tool_calls"]
            lps = {"content": logprob_entries(self.tokenizer, m["logprobs"])} if self.req.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": m["finish"]})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.req.model,
                "choices": choices, "usage": self.usage}

    @property
    def _include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def _chunk(self, index: int, delta: dict, finish=None, logprobs=None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self._include_usage:
            body["usage"] = None
        return sse(body)

    async def sse(self):
        for c in self.choices:
            yield self._chunk(c.index, {"role": "assistant", "content": ""})
        async with aclosing(self.events()) as events:
            async for ev in events:
                if ev.error:
                    yield sse(error_body(ev.error_status, ev.error, ev.error_code))
                    break
                delta = {}
                if ev.reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = ev.reasoning
                if ev.content:
                    delta["content"] = ev.content
                calls = [tool_call_delta(e) for e in ev.tool_calls if e[0] != "tool_end"]
                if calls:
                    delta["tool_calls"] = calls
                lps = {"content": logprob_entries(self.tokenizer, ev.logprobs)} if ev.logprobs else None
                if delta or lps:
                    yield self._chunk(ev.index, delta, None, lps)
                if ev.finish:
                    yield self._chunk(ev.index, {}, ev.finish)
        if self._include_usage:
            yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.req.model, "choices": [], "usage": self.usage})
        yield "data: [DONE]\n\n"
