"""POST /v1/chat/completions with server-side MCP tools (engine.server.mcp_tools): the rounds of
engine.server.mcp_rounds, answered in one body with what ran in `mcp_calls`, or streamed: each round's content
chunks as they come, its tool-call chunks held back until the round is known to be the last (a round of MCP calls
is not shown as calls: they ran here), then one last chunk with `mcp_calls` (no choices), the usage chunk when
asked for, and [DONE]."""
from __future__ import annotations

import json

from engine.server.errors import APIError
from engine.server.mcp_rounds import Call, public, relaxed, rounds
from engine.server.mcp_tools import expand


def _add_usage(total: dict | None, usage: dict) -> dict:
    if total is None:
        return json.loads(json.dumps(usage))
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] += usage.get(key, 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if "prompt_tokens_details" in total:
        total["prompt_tokens_details"]["cached_tokens"] += cached
    return total


class ChatConversation:
    no_tools = "none"
    relaxed = staticmethod(relaxed)

    def __init__(self, req, state, tools: list[dict], stream: bool):
        self.req, self.state, self.tools, self.stream = req, state, tools, stream
        self.messages = [m.model_dump(exclude_none=True) for m in req.messages]
        self.usage: dict | None = None
        self.message: dict = {}
        self.body: dict | None = None  # the last round's whole answer (not streamed)
        self.reply = self.pending = None

    def _request(self, tool_choice):
        from engine.server.schemas import ChatCompletionRequest

        body = self.req.model_dump(exclude_none=True, by_alias=True)
        body.update(messages=self.messages, tools=self.tools, tool_choice=tool_choice, stream=self.stream)
        return ChatCompletionRequest.model_validate(body)

    async def begin(self, tool_choice) -> None:
        """Starts the first round before the answer does, so what the request cannot do is its status code."""
        from engine.server.chat import prepare_reply

        self.pending = await prepare_reply(self._request(tool_choice), self.state)

    async def round(self, tool_choice):
        if self.pending is None:
            await self.begin(tool_choice)
        self.reply, self.pending = self.pending, None
        if not self.stream:
            self.body = await self.reply.whole()
            self.usage = _add_usage(self.usage, self.body["usage"])
            self.message = self.body["choices"][0]["message"]
            return
        calls: dict[int, dict] = {}
        content: list[str] = []
        self.message = {"role": "assistant", "content": None}
        async for chunk in self.reply.sse():
            yield chunk
            body = json.loads(chunk[len("data: "):]) if chunk.startswith("data: {") else {}
            for choice in body.get("choices") or []:
                content.append(choice["delta"].get("content") or "")
                for d in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                    call["function"]["name"] += (d.get("function") or {}).get("name") or ""
                    call["function"]["arguments"] += (d.get("function") or {}).get("arguments") or ""
            if "error" in body:
                calls = {}
        self.usage = _add_usage(self.usage, self.reply.usage)
        self.message["content"] = "".join(content) or None
        if calls:
            self.message["tool_calls"] = [calls[i] for i in sorted(calls)]

    def calls(self) -> list[Call]:
        return [Call(c["id"], c["function"]["name"], c["function"].get("arguments") or "{}")
                for c in self.message.get("tool_calls") or []]

    def add(self, calls: list[Call], done: list[dict | None]) -> None:
        from engine.server.mcp_rounds import OVER_LIMIT

        self.messages.append({k: v for k, v in self.message.items() if k in ("role", "content", "tool_calls")})
        for call, ran in zip(calls, done):
            self.messages.append({"role": "tool", "tool_call_id": call.id,
                                  "content": ran["output"] if ran else OVER_LIMIT})


async def chat_with_mcp(req, state, request=None):
    """The answer to a chat request with MCP tools: a JSON body, or the stream."""
    from fastapi.responses import JSONResponse, StreamingResponse

    from engine.server.chat import SSE_HEADERS
    from engine.server.generation import unless_disconnected

    if req.n != 1:
        raise APIError(400, "Server-side MCP tools run one conversation: n must be 1.", param="n")
    state.check_model(req.model)
    tools, named, _ = await expand(state, req.tools)
    convo = ChatConversation(req, state, tools, bool(req.stream))
    await convo.begin(req.tool_choice)
    if req.stream:
        return StreamingResponse(_stream(convo, state, named), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await unless_disconnected(request, _whole(convo, state, named)))


async def _whole(convo: ChatConversation, state, named) -> dict:
    async for kind, value in rounds(convo, state, named, convo.req.tool_choice):
        if kind == "final":
            body = convo.body
            body["usage"], body["mcp_calls"] = convo.usage, [public(d) for d in value]
            return body


def _is_held(body: dict) -> bool:
    """A chunk shown only when its round is the last: tool-call pieces and the finish chunk."""
    return any(c["delta"].get("tool_calls") or c.get("finish_reason") for c in body.get("choices") or [])


async def _stream(convo: ChatConversation, state, named):
    """The rounds' chunks under one id (the first round's role chunk once), then `mcp_calls`, usage, [DONE]."""
    include_usage = bool(convo.req.stream_options and convo.req.stream_options.include_usage)
    try:
        async for chunk in _chunks(convo, state, named, include_usage):
            yield chunk
    except APIError as e:  # a later round the engine could not take (e.g. the results overflow the context)
        yield _sse(e.body())
        yield "data: [DONE]\n\n"


async def _chunks(convo: ChatConversation, state, named, include_usage: bool):
    held: list[dict] = []
    first: dict | None = None
    async for kind, value in rounds(convo, state, named, convo.req.tool_choice):
        if kind == "ran":
            held = []
            continue
        if kind == "final":
            for body in held:
                yield _sse(body)
            yield _sse({**first, "choices": [], "mcp_calls": [public(d) for d in value]})
            if include_usage:
                yield _sse({**first, "choices": [], "usage": convo.usage})
            yield "data: [DONE]\n\n"
            return
        if not value.startswith("data: {"):
            continue  # each round's [DONE]
        body = json.loads(value[len("data: "):])
        if "error" in body:
            yield value
            continue
        if not body["choices"]:
            continue  # a round's usage chunk: the total comes at the end
        if first is None:
            first = {k: body[k] for k in ("id", "object", "created", "model")}
        elif body["choices"][0]["delta"].get("role") and len(body["choices"][0]["delta"]) == 2 \
                and not body["choices"][0]["delta"]["content"]:
            continue  # a later round's opening role chunk
        body.update(id=first["id"], created=first["created"])
        if _is_held(body):
            held.append(body)
        else:
            yield _sse(body)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
