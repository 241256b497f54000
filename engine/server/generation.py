"""From engine outputs to API events, shared by the completion endpoints: one `Choice` per generated sequence turns
token ids into text, reasoning, tool calls and logprobs; `run_choices` runs n of them and merges their events."""
from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass, field

from engine.constrain import Constraint, UnsupportedSchema, json_object_constraint, json_schema_constraint
from engine.engine import ContextLengthError, QueueFullError
from engine.errors import NInferError
from engine.sampling import SamplingParams
from engine.server.errors import APIError, shown
from engine.server.parsers import ReasoningSplitter, ToolCallStreamer
from engine.server.schemas import SamplingFields
from engine.server.state import ServerState
from engine.server.textstream import TextStream


def check_room(state: ServerState, prompt_tokens: int, context: int, param: str) -> None:
    """A 400 context_length_exceeded naming what sets the context (the model, --max-context, the host KV tier...)
    when a prompt of `prompt_tokens` leaves no room for one token of answer."""
    if context - prompt_tokens >= 1:
        return
    limit = getattr(getattr(state.loaded, "engine", None), "context_limit", "the context length")
    if not isinstance(limit, str) or limit == "the context length":
        limit = "this model's context length"
    raise APIError(400, f"The context holds {context} tokens (set by {limit}), and the prompt has "
                        f"{prompt_tokens}: no room for an answer. Shorten the input.",
                   code="context_length_exceeded", param=param)


def sampling_params(req: SamplingFields, state: ServerState, prompt_tokens: int, context: int,
                    logprobs: int | None = None, param: str = "messages") -> SamplingParams:
    """Request values over the mode's defaults; max_tokens is capped to the room left in the context."""
    d, s = state.defaults, state.settings
    check_room(state, prompt_tokens, context, param)
    room = context - prompt_tokens
    wanted = req.max_completion_tokens or req.max_tokens or s.default_max_tokens

    def pick(name):
        value = getattr(req, name)
        return d[name] if value is None else value

    return SamplingParams(
        max_tokens=min(wanted, room), logit_bias=_logit_bias(req.logit_bias, state),
        temperature=0.0 if s.greedy else pick("temperature"),
        top_p=pick("top_p"), top_k=max(int(pick("top_k")), 0), min_p=pick("min_p"),
        presence_penalty=pick("presence_penalty"), frequency_penalty=pick("frequency_penalty"),
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs,
    )


_widest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_widest_lock = threading.Lock()


def widest_token(tokenizer) -> int:
    """The most characters one token can add to a text: the longest token's UTF-8 bytes (a token that is part of a
    character decodes to U+FFFD, 3 bytes, never fewer than its own). Found once per tokenizer (~0.2 s)."""
    with _widest_lock:
        found = _widest.get(tokenizer)
        if found is None:
            found = max(len(tokenizer.token_text(t).encode("utf-8", "surrogatepass"))
                        for t in range(tokenizer.vocab_size))
            _widest[tokenizer] = found
        return found


def check_prompt_chars(tokenizer, text: str, context: int, param: str) -> None:
    """A 400 context_length_exceeded, before encoding, for a prompt too long to fit whatever its tokens: encoding
    holds the interpreter for seconds per megabyte, which a prompt that is refused anyway should not cost."""
    widest = widest_token(tokenizer)
    if len(text) >= context * widest:
        raise APIError(400, f"The prompt has {len(text)} characters; the context holds {context} tokens of at most "
                            f"{widest} characters each, so it cannot fit. Shorten the input.",
                       code="context_length_exceeded", param=param)


def response_constraint(tokenizer, response_format, start_after: int | None = None) -> Constraint | None:
    """The grammar a request's response_format asks for (None for text); a 400 when it cannot be enforced, never
    unconstrained output. Compiling may take a moment (the first time, ~0.5 s for the tokenizer): call it in a
    worker thread."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        if response_format.type == "json_object":
            return json_object_constraint(tokenizer, start_after)
        return json_schema_constraint(tokenizer, response_format.json_schema.schema_, start_after)
    except UnsupportedSchema as e:
        raise APIError(400, str(e), param="response_format") from None


def _logit_bias(bias: dict[str, float] | None, state: ServerState) -> dict[int, float]:
    vocab = state.ready().tokenizer.vocab_size
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise APIError(400, f"logit_bias key {shown(key)} is not a token id of this model (0..{vocab - 1}).",
                           param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias value for {shown(key)} must be between -100 and 100.", param="logit_bias")
        out[token] = float(value)
    return out


CUT_MESSAGE = ("The server stopped this request before its answer was finished (the model was switched, or the "
               "server shut down). Send the request again.")


@dataclass
class Event:
    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)  # the streamer's "tool_call" / "tool_args" / "tool_end" events
    logprobs: list = field(default_factory=list)  # engine TokenLogprob entries
    finish: str | None = None
    error: str | None = None  # the request failed (or was cut) before its end: what the client is told
    error_status: int = 500
    error_code: str = "engine_error"


class Choice:
    """One generated sequence: detokenizes, cuts at stop strings, splits reasoning, parses tool calls."""

    def __init__(self, index: int, tokenizer, stops: list[str], *, reasoning: bool = False,
                 starts_in_reasoning: bool = False, tool_names: set[str] | dict[str, dict] | None = None,
                 parallel_calls: bool = True):
        self.index = index
        self.text = TextStream(tokenizer, stops)
        self.splitter = ReasoningSplitter(starts_in_reasoning) if reasoning else None
        self.tools = ToolCallStreamer(tool_names, parallel_calls) if tool_names else None
        self.called = False

    def _route(self, text: str, final: bool, ev: Event) -> None:
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text)
            if final:
                r2, c2 = self.splitter.flush()
                reasoning, text = reasoning + r2, text + c2
            ev.reasoning += reasoning
        if self.tools is None:
            ev.content += text
            return
        events = self.tools.feed(text) + (self.tools.flush() if final else [])
        for e in events:
            if e[0] == "content":
                ev.content += e[1]
            else:
                ev.tool_calls.append(e)
                self.called = True

    def on_output(self, out) -> Event:
        ev = Event(self.index, logprobs=list(out.logprobs or []))
        text = self.text.feed(out.token_ids)
        final = out.finished or self.text.stopped
        if final and not self.text.stopped:
            text += self.text.finish()
        self._route(text, final, ev)
        if final:
            if out.error:
                ev.error = out.error
            elif out.finish_reason == "abort" and not self.text.stopped:  # cut by the server, not by the client
                ev.error, ev.error_status, ev.error_code = CUT_MESSAGE, 503, "request_cut"
            budget = out.finish_reason == "length" and not self.text.stopped
            cut = budget and self.tools is not None and self.tools.cut  # a call cut off: still a call, partial
            ev.finish = "length" if cut else "tool_calls" if self.called else "length" if budget else "stop"
        return ev


INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def sibling_seed(seed: int | None, i: int) -> int | None:
    """The seed of a request's i-th sequence: seed + i, wrapped into int64 so the last seeds stay valid."""
    return None if seed is None else (seed + i - INT64_MIN) % 2**64 + INT64_MIN


def check_fits(engine, sequences: int, prompts: int, param: str = "n") -> None:
    """A 400 when a request holds more sequences than the server will ever run or queue at once (retrying
    cannot help); the engine's own queue check (a 429) covers a server busy with other requests."""
    running = getattr(getattr(engine, "scheduler", None), "max_concurrency", None)
    queued = getattr(engine, "max_queue", None)
    if not isinstance(running, int) or not isinstance(queued, int) or sequences <= running + queued:
        return
    what = f"{prompts} prompts x n={sequences // max(prompts, 1)}" if prompts > 1 else f"n={sequences}"
    raise APIError(400, f"This request asks for {sequences} sequences ({what}), more than this server runs or "
                        f"queues at once: {running + queued} (--max-concurrency {running} + --max-queue {queued}). "
                        f"Send at most {running + queued} sequences per request, or raise --max-queue.",
                   code="too_many_sequences", param=param)


def submit(state: ServerState, prompt: list[int], params: SamplingParams, n: int, param: str = "messages",
           images: list | None = None):
    """n engine requests for one API request (seeds seed, seed+1, ... so choices differ but stay reproducible);
    `images`: the prompt's images in order (each stands in `prompt` as its run of <|image_pad|>), or None."""
    return submit_all(state, [(prompt, params)], n, param, images=images)


def submit_all(state: ServerState, jobs: list[tuple[list[int], SamplingParams]], n: int,
               param: str = "messages", count_param: str = "n", images: list | None = None):
    """n engine requests per (prompt, params) job, admitted whole or not at all: when any submission fails, the
    ones already submitted are aborted at once, so no sequence runs on for a request that got an error. Every
    job's sequences get the same `images` (None: a text-only prompt)."""
    with_images = {"images": images} if images else {}  # engines without vision take no images argument
    engine = state.ready().engine
    check_fits(engine, len(jobs) * n, len(jobs), count_param)
    loop = asyncio.get_running_loop()
    streams = []
    try:
        for prompt, params in jobs:
            for i in range(n):
                p = params if i == 0 else SamplingParams(**{**vars(params), "seed": sibling_seed(params.seed, i)})
                streams.append(engine.submit(prompt, p, loop=loop, **with_images))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, ContextLengthError):
            raise APIError(400, str(e), code="context_length_exceeded", param=param) from None
        if isinstance(e, QueueFullError):
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
        if isinstance(e, NInferError):  # e.g. images the engine cannot take: about the messages that hold them
            raise APIError(400, str(e), param=param if images else None) from None
        raise
    return streams


async def run_choices(streams, choices: list[Choice], usage: dict):
    """Yields Events from all choices as they come; aborts every unfinished engine request when the consumer
    stops listening (client gone, error) or a stop string ends a choice."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream, choice):
        try:
            async for out in stream:
                usage["completion_tokens"][choice.index] = out.completion_tokens
                if "cached_tokens" in usage:  # prompt tokens served from the prefix cache, when the engine says
                    usage["cached_tokens"][choice.index] = getattr(out, "cached_tokens", 0) or 0
                if out.spec_drafted and "speculation" in usage:
                    usage["speculation"][choice.index] = (out.spec_drafted, out.spec_accepted)
                ev = choice.on_output(out)
                await queue.put(ev)
                if ev.finish:
                    break
        finally:
            stream.abort()  # no-op for a finished request; frees the pages of one ended by a stop string
            await queue.put(None)

    tasks = [asyncio.create_task(pump(s, c)) for s, c in zip(streams, choices)]
    try:
        remaining = len(tasks)
        while remaining:
            ev = await queue.get()
            if ev is None:
                remaining -= 1
            else:
                yield ev
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def unless_disconnected(request, coro, poll: float = 0.25):
    """Awaits coro, cancelling it (and so aborting its engine requests) when the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "The client closed the connection.", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


def usage_dict(prompt_tokens: int, completion: dict[int, int], speculation: dict | None = None,
               cached: dict[int, int] | None = None, per_prompt: int = 1) -> dict:
    """OpenAI usage. prompt_tokens_details.cached_tokens: the prompt tokens the engine reused from its prefix cache
    instead of computing (`cached`: per choice, choices `per_prompt` to a prompt; a prompt counts once, with what
    every one of its choices reused). With speculative decoding, completion_tokens_details counts the drafted
    tokens the model accepted and rejected (the fields OpenAI uses for predicted outputs)."""
    done = sum(completion.values())
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}
    if cached is not None:
        counts = [cached[i] for i in sorted(cached)]
        step = max(per_prompt, 1)
        usage["prompt_tokens_details"] = {"cached_tokens": sum(min(counts[k:k + step])
                                                               for k in range(0, len(counts), step))}
    if speculation:
        drafted = sum(d for d, _ in speculation.values())
        accepted = sum(a for _, a in speculation.values())
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": drafted - accepted}
    return usage
