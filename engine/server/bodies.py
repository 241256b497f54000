"""Request bodies read off the event loop: the API routes parse and validate their JSON body in a worker thread, so a
large body (up to --max-body-mib) never holds up /health or other clients while it is read or refused.

Before a body is parsed its values are counted (engine.server.bodyjson: no parse holds the interpreter long), and
before the request model validates it, the lists and maps the model bounds (`messages`, `tools`, `logit_bias`)
are checked for length, so an oversized one is refused at once instead of after every item in it was validated. Text that is not valid
Unicode (a lone surrogate, which only a \\uD800-\\uDFFF escape or the bytes ED A0..BF can carry) is looked for only
in a body that holds such an escape or bytes.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing

from annotated_types import MaxLen
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server.bodyjson import check_size, loads
from engine.server.errors import invalid_text_at, invalid_text_message

_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _invalid(kind: str, loc: tuple, msg: str, ctx: dict | None = None) -> RequestValidationError:
    return RequestValidationError([{"type": kind, "loc": ("body", *loc), "msg": msg, "input": None,
                                    "ctx": ctx or {}}])


def list_bounds(model: type[BaseModel]) -> dict[str, int]:
    """The fields of a request model that are lists (or maps) of at most N items: {alias: N}."""
    bounds = {}
    for name, field in model.model_fields.items():
        for rule in field.metadata:
            if isinstance(rule, MaxLen):
                bounds[field.alias or name] = rule.max_length
    return bounds


def read_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """The request model of a JSON body; RequestValidationError (a 400 in the API's shape) when it is not one.
    CPU-bound: call it in a worker thread."""
    check_size(raw)
    try:
        data = loads(raw)
    except json.JSONDecodeError as e:
        raise _invalid("json_invalid", (e.pos,), "JSON decode error", {"error": e.msg}) from None
    except UnicodeDecodeError:
        raise _invalid("json_invalid", (), "JSON decode error", {"error": "the body is not UTF-8 text"}) from None
    except RecursionError:
        raise _invalid("json_invalid", (), "JSON decode error", {"error": "it is nested too deeply"}) from None
    if isinstance(data, dict):
        for name, limit in list_bounds(model).items():
            value = data.get(name)
            if isinstance(value, (list, dict)) and len(value) > limit:
                kind = "List" if isinstance(value, list) else "Object"
                raise _invalid("too_long", (name,), f"{kind} should have at most {limit} items, not {len(value)}")
    if _SURROGATE.search(raw):
        where = invalid_text_at(data)
        if where is not None:
            raise _invalid("invalid_text", (), invalid_text_message(where), {"where": where})
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


class ThreadedBodyRoute(APIRoute):
    """An API route whose endpoint is `async def endpoint(req: Model[, request: Request])`: the body becomes the
    model in a worker thread (the OpenAPI schema is still the endpoint's), then the endpoint runs on the loop. A
    plain result (a dict) is answered as JSON."""

    def get_route_handler(self):
        params = inspect.signature(self.endpoint).parameters
        model = typing.get_type_hints(self.endpoint)[next(n for n in params if n != "request")]
        wants_request = "request" in params
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            req = await asyncio.to_thread(read_body, model, await request.body())
            result = await (endpoint(req, request) if wants_request else endpoint(req))
            return result if isinstance(result, Response) else JSONResponse(result)

        return handler
