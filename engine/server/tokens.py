"""Token routes that generate nothing: counting a request's prompt, and the tokenizer and chat template on their own.

- ``POST /v1/responses/input_tokens`` (OpenAI's Responses input token count) and ``POST /v1/chat/completions/
  input_tokens`` (llama-server's, for a chat body) answer ``{"object": "response.input_tokens", "input_tokens": N}``:
  N is the prompt length the generation route would report in its usage for the same body (the same rendering).
- ``POST /tokenize`` (``content``, ``add_special``, ``parse_special``, ``with_pieces``), ``POST /detokenize``
  (``tokens``) and ``POST /apply-template`` (a chat body -> ``{"prompt": ...}``), in llama-server's shapes.

Bodies are read like the other routes' (engine.server.bodies: size-bounded, parsed in a worker thread); the work (a
long text takes seconds to encode) and, for the token lists, the JSON of the answer are done in a worker thread too.
``model`` is optional here; when it is sent it must name a served model, as on the generation routes.
"""
from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi.responses import Response
from pydantic import Field, PlainValidator

from engine.server.chat import render, render_text
from engine.server.errors import APIError
from engine.server.responses import ResponsesRequest, check_nothing_stored, prepare
from engine.server.responses_input import read_tools
from engine.server.schemas import MAX_MESSAGES, Bool, ChatCompletionRequest, Int, _Open
from engine.server.state import ServerState

INPUT_TOKENS = "response.input_tokens"


def _token_ids(value: Any) -> list[int]:
    if isinstance(value, list) and all(type(t) is int for t in value):  # a loop: other threads run meanwhile
        return value
    raise ValueError("tokens must be a list of token ids (whole numbers)")


TokenIds = Annotated[list[Int], PlainValidator(_token_ids, json_schema_input_type=list[Int])]


class TokenizeRequest(_Open):
    content: str
    add_special: Bool = False  # the tokenizer's own special tokens (BOS...) around the text
    parse_special: Bool = True  # special-token text in the content (e.g. "<|im_end|>") read as those tokens
    with_pieces: Bool = False  # each token as {"id", "piece"}
    model: str | None = None


class DetokenizeRequest(_Open):
    tokens: TokenIds
    model: str | None = None


class ChatBody(ChatCompletionRequest):
    """A chat completions body whose model may be left out (the served model is meant)."""
    model: str | None = None


class ResponsesInputTokensRequest(ResponsesRequest):
    """OpenAI's input token count body: a Responses body whose model and input may be left out."""
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None


def _served(state: ServerState, model: str | None) -> str:
    """The served id a body's model names (the first served id when it names none); 404 for an unknown name."""
    served = state.check_model(model) if model is not None else state.model_ids[0]
    state.ready()
    return served


def _json(body: dict) -> Response:
    return Response(json.dumps(body, ensure_ascii=False).encode("utf-8"), media_type="application/json")


def _piece(tok, lltok, token: int) -> str | list[int]:
    """A token's text, or its bytes as a list of numbers when they are not valid UTF-8 on their own (part of a
    character), as llama-server gives it."""
    if lltok.is_special_token(token):
        return tok.token_text(token)
    raw = lltok.decode_bytes([token])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _tokenize(state: ServerState, req: TokenizeRequest) -> Response:
    tok = state.ready().tokenizer
    ids = tok.encode(req.content, add_special_tokens=req.add_special, parse_special=req.parse_special)
    if not req.with_pieces:
        return _json({"tokens": ids})
    from engine.constrain import llg_tokenizer  # the token bytes (built once per tokenizer, ~0.5 s)

    lltok = llg_tokenizer(tok)
    return _json({"tokens": [{"id": t, "piece": _piece(tok, lltok, t)} for t in ids]})


def _detokenize(state: ServerState, req: DetokenizeRequest) -> Response:
    tok = state.ready().tokenizer
    bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"Token id {bad} is not a token of this model (ids are 0..{tok.vocab_size - 1}).",
                       param="tokens")
    return _json({"content": tok.decode(req.tokens, skip_special_tokens=False)})


def _responses_prompt(state: ServerState, req: ResponsesInputTokensRequest, served: str) -> int:
    body = req.model_copy(update={"input": req.input if req.input is not None else []})
    _, prompt, _, _ = prepare(state, body, served, read_tools(req.tools))
    return len(prompt)


def routes(state: ServerState) -> list[tuple[str, Any, bool]]:
    """(path, endpoint, also without /v1): for app.py to add as ThreadedBodyRoute routes."""

    async def count_response_input_tokens(req: ResponsesInputTokensRequest):
        served = _served(state, req.model)
        check_nothing_stored(req)
        n = await asyncio.to_thread(_responses_prompt, state, req, served)
        return {"object": INPUT_TOKENS, "input_tokens": n}

    async def count_chat_input_tokens(req: ChatBody):
        _served(state, req.model)
        prompt, _, _ = await asyncio.to_thread(render, state, req)
        return {"object": INPUT_TOKENS, "input_tokens": len(prompt)}

    async def tokenize(req: TokenizeRequest):
        _served(state, req.model)
        return await asyncio.to_thread(_tokenize, state, req)

    async def detokenize(req: DetokenizeRequest):
        _served(state, req.model)
        return await asyncio.to_thread(_detokenize, state, req)

    async def apply_template(req: ChatBody):
        _served(state, req.model)
        return {"prompt": await asyncio.to_thread(render_text, state, req)}

    return [("/v1/responses/input_tokens", count_response_input_tokens, True),
            ("/v1/chat/completions/input_tokens", count_chat_input_tokens, True),
            ("/tokenize", tokenize, False), ("/detokenize", detokenize, False),
            ("/apply-template", apply_template, False)]
