"""POST /v1/chat/completions: render the chat, submit to the engine, answer in one body or as SSE chunks."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from engine.engine import ContextLengthError
from engine.errors import NInferError
from engine.sampling import SamplingParams
from engine.server.errors import APIError, error_body
from engine.server.schemas import ChatCompletionRequest, SamplingFields
from engine.server.state import ServerState
from engine.server.textstream import TextStream


def sampling_params(req: SamplingFields, state: ServerState, prompt_tokens: int, context: int,
                    logprobs: int | None = None) -> SamplingParams:
    """Request values over the mode's defaults; max_tokens is capped to the room left in the context."""
    d, s = state.defaults, state.settings
    room = context - prompt_tokens
    if room < 1:
        raise APIError(400, f"This model's context is {context} tokens, and the prompt has {prompt_tokens}: no "
                            f"room for an answer. Shorten the messages.", code="context_length_exceeded",
                       param="messages")
    wanted = req.max_completion_tokens or req.max_tokens or s.default_max_tokens
    top_k = d["top_k"] if req.top_k is None else max(req.top_k, 0)

    def pick(name):
        value = getattr(req, name)
        return d[name] if value is None else value

    return SamplingParams(
        max_tokens=min(wanted, room),
        temperature=0.0 if s.greedy else pick("temperature"),
        top_p=pick("top_p"), top_k=int(top_k), min_p=pick("min_p"),
        presence_penalty=pick("presence_penalty"), frequency_penalty=pick("frequency_penalty"),
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs,
    )


def _render(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = state.loaded.tokenizer
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        return tok.apply_chat_template(messages, tools=req.tools, add_generation_prompt=True)
    except NInferError as e:
        raise APIError(400, str(e), param="messages") from None


def _logprob_entries(tokenizer, out) -> list[dict]:
    entries = []
    for lp in out.logprobs or []:
        def item(tid, value):
            text = tokenizer.token_text(tid)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
        entry = item(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [item(t, v) for t, v in lp.top]
        entries.append(entry)
    return entries


async def chat_completions(req: ChatCompletionRequest, state: ServerState):
    state.check_model(req.model)
    loaded = state.ready()
    if req.n != 1:
        raise APIError(400, "n > 1 is not available in this version; send n=1 (or several requests).", param="n")
    prompt = _render(state, req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, state, len(prompt), loaded.context_window, logprobs)
    try:
        stream = loaded.engine.submit(prompt, params, loop=asyncio.get_running_loop())
    except ContextLengthError as e:
        raise APIError(400, str(e), code="context_length_exceeded", param="messages") from None
    except NInferError as e:
        raise APIError(400, str(e)) from None
    reply = _Reply(req, loaded.tokenizer, stream, len(prompt))
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await reply.whole())


class _Reply:
    def __init__(self, req: ChatCompletionRequest, tokenizer, stream, prompt_tokens: int):
        self.req, self.tokenizer, self.stream = req, tokenizer, stream
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = TextStream(tokenizer, req.stop_list())
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}

    async def _events(self):
        """Yields (text delta, logprob entries, finish_reason or None, error or None); aborts the engine request
        when the consumer goes away or a stop string ends it."""
        finished = False
        try:
            async for out in self.stream:
                self.usage["completion_tokens"] = out.completion_tokens
                self.usage["total_tokens"] = out.prompt_tokens + out.completion_tokens
                delta = self.text.feed(out.token_ids)
                lps = _logprob_entries(self.tokenizer, out) if out.logprobs else None
                if self.text.stopped:
                    finished = True
                    yield delta, lps, "stop", None
                    return
                if out.finished:
                    finished = True
                    delta += self.text.finish()
                    reason = "length" if out.finish_reason == "length" else "stop"
                    yield delta, lps, reason, out.error
                    return
                yield delta, lps, None, None
        finally:
            if not finished:
                self.stream.abort()
            elif self.text.stopped:
                self.stream.abort()

    async def whole(self) -> dict:
        parts, lps, reason = [], [], "stop"
        async for delta, entries, finish, error in self._events():
            if error:
                raise APIError(500, error, code="engine_error")
            parts.append(delta)
            lps.extend(entries or [])
            reason = finish or reason
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                         "logprobs": {"content": lps} if self.req.logprobs else None, "finish_reason": reason}],
            "usage": self.usage,
        }

    def _chunk(self, delta: dict, finish=None, lps=None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": {"content": lps} if lps else None,
                             "finish_reason": finish}]}
        if self._include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    @property
    def _include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def sse(self):
        yield self._chunk({"role": "assistant", "content": ""})
        async for delta, lps, finish, error in self._events():
            if error:
                yield f"data: {json.dumps(error_body(500, error, 'engine_error'))}\n\n"
                break
            if delta or lps:
                yield self._chunk({"content": delta}, None, lps)
            if finish:
                yield self._chunk({}, finish)
        if self._include_usage:
            body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.req.model, "choices": [], "usage": self.usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
