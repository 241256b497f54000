"""POST /v1/completions: plain-text (or token-id) prompts, no chat template."""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from engine.server.chat import SSE_HEADERS, sse
from engine.server.errors import APIError, error_body
from engine.server.generation import (Choice, check_fits, check_prompt_chars, check_room, response_constraint,
                                       run_choices, sampling_params, submit_all, unless_disconnected, usage_dict)
from engine.server.schemas import CompletionRequest
from engine.server.state import ServerState


def _legacy_logprobs(tokenizer, entries, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in entries:
        text = tokenizer.token_text(lp.token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append({tokenizer.token_text(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def encode_prompts(state: ServerState, req: CompletionRequest, context: int) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt; a 400 for an empty prompt or ids outside the vocabulary. CPU-bound (a
    long prompt takes seconds to encode): call it in a worker thread."""
    tok, prompts = state.loaded.tokenizer, []
    for p in req.prompts():
        if isinstance(p, str):
            check_prompt_chars(tok, p, context, "prompt")
        ids = tok.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt")
        check_room(state, len(ids), context, "prompt")  # before the ids are checked one by one
        if any(not 0 <= t < tok.vocab_size for t in ids):
            raise APIError(400, f"Prompt token ids must be between 0 and {tok.vocab_size - 1}.", param="prompt")
        prompts.append((p if isinstance(p, str) else tok.decode(ids), ids))
    return prompts


async def completions(req: CompletionRequest, state: ServerState, request=None):
    state.check_model(req.model)
    loaded = state.ready()
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not available in this version; send the prompt only.",
                       param="suffix")
    tok = loaded.tokenizer
    count = len(req.prompts())  # every count checked before any prompt is looked at
    check_fits(loaded.engine, count * req.n, count, "prompt" if count > 1 else "n")
    prompts = await asyncio.to_thread(encode_prompts, state, req, loaded.context_window)
    constraint = await asyncio.to_thread(response_constraint, tok, req.response_format)
    jobs, choices, echoes = [], [], []
    for k, (text, ids) in enumerate(prompts):  # every prompt checked before any is submitted
        params = sampling_params(req, state, len(ids), loaded.context_window, req.logprobs, param="prompt")
        params.constraint = constraint  # a template: each engine sequence gets its own copy
        jobs.append((ids, params))
        for j in range(req.n):
            choices.append(Choice(k * req.n + j, tok, req.stop_list()))
            echoes.append(text if req.echo else "")
    streams = submit_all(state, jobs, req.n, param="prompt", count_param="prompt" if len(jobs) > 1 else "n")
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    reply = _Reply(req, tok, streams, choices, echoes, prompt_tokens)
    if req.stream:
        return StreamingResponse(reply.sse(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await unless_disconnected(request, reply.whole()))


class _Reply:
    def __init__(self, req, tokenizer, streams, choices, echoes, prompt_tokens):
        self.req, self.tokenizer, self.streams, self.choices, self.echoes = req, tokenizer, streams, choices, echoes
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.completion = {c.index: 0 for c in choices}
        self.cached = {c.index: 0 for c in choices}  # prompt tokens each choice's sequence reused from the cache
        self.speculation: dict[int, tuple[int, int]] = {}  # choice -> (drafted, accepted) when speculating

    def _body(self, choices, usage=None) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.req.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def events(self):
        usage = {"completion_tokens": self.completion, "cached_tokens": self.cached, "speculation": self.speculation}
        return run_choices(self.streams, self.choices, usage)

    def usage(self) -> dict:
        return usage_dict(self.prompt_tokens, self.completion, self.speculation, self.cached, self.req.n)

    async def whole(self) -> dict:
        acc = {c.index: {"text": [self.echoes[c.index]], "lps": [], "finish": "stop"} for c in self.choices}
        async with aclosing(self.events()) as events:
            async for ev in events:
                if ev.error:
                    raise APIError(ev.error_status, ev.error, code=ev.error_code)
                acc[ev.index]["text"].append(ev.content)
                acc[ev.index]["lps"].extend(ev.logprobs)
                acc[ev.index]["finish"] = ev.finish or acc[ev.index]["finish"]
        choices = [{"index": i, "text": "".join(a["text"]), "finish_reason": a["finish"],
                    "logprobs": _legacy_logprobs(self.tokenizer, a["lps"], len(self.echoes[i]))
                    if self.req.logprobs is not None else None} for i, a in acc.items()]
        return self._body(choices, self.usage())

    async def sse(self):
        offsets = {c.index: len(self.echoes[c.index]) for c in self.choices}
        for c in self.choices:
            if self.echoes[c.index]:
                yield sse(self._body([{"index": c.index, "text": self.echoes[c.index], "logprobs": None,
                                       "finish_reason": None}]))
        async with aclosing(self.events()) as events:
            async for ev in events:
                if ev.error:
                    yield sse(error_body(ev.error_status, ev.error, ev.error_code))
                    break
                lps = None
                if self.req.logprobs is not None and ev.logprobs:
                    lps = _legacy_logprobs(self.tokenizer, ev.logprobs, offsets[ev.index])
                offsets[ev.index] += len(ev.content)
                if ev.content or lps or ev.finish:
                    yield sse(self._body([{"index": ev.index, "text": ev.content, "logprobs": lps,
                                           "finish_reason": ev.finish}]))
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse(self._body([], self.usage()))
        yield "data: [DONE]\n\n"
