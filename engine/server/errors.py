"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}; on the Anthropic routes
(/v1/messages...) in Anthropic's: {"type": "error", "error": {"type", "message"}}, with the same statuses."""
from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ninfer.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
          503: "service_unavailable"}


# Anthropic's error types by status (docs.anthropic.com/en/api/errors); 503 (loading) reads as overloaded.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages", "/messages")


def is_anthropic(path: str) -> bool:
    """Whether a request path belongs to the Anthropic Messages API (its errors take Anthropic's shape)."""
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


MAX_MESSAGE_CHARS, MAX_PARAM_CHARS, MAX_SHOWN_CHARS = 4096, 200, 100


def clip(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """Text cut to `limit` characters with "…": a value a client sent is echoed in part, never a megabyte of it."""
    return text if len(text) <= limit else text[:limit] + "…"


def shown(value) -> str:
    """A value a client sent, as an error message quotes it: its repr, cut to MAX_SHOWN_CHARS."""
    return clip(repr(value))


def printable(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate (valid in a JSON string escape, not in UTF-8) shows as \\udxxx."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid_text_at(value, where: str = "") -> str | None:
    """The path (e.g. "messages.0.content") of the first string or key in a parsed JSON value that is not valid
    Unicode (a lone surrogate such as \\ud800, which JSON escapes allow and no tokenizer or UTF-8 output takes)."""
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and not _encodes(v):
                return path or "body"
        elif isinstance(v, dict):
            items = list(v.items())
            for k, x in reversed(items):
                key = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not k.isascii() and not _encodes(k):
                    return printable(key)
                stack.append((key, x))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in reversed(list(enumerate(v))))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def invalid_text_message(where: str) -> str:
    return (f"{where} holds text that is not valid Unicode (a lone surrogate such as \\ud800, which no "
            "tokenizer can read); send it as UTF-8 text.")


def anthropic_error_body(status: int, message: str) -> dict:
    message = clip(printable(message), MAX_MESSAGE_CHARS)
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def body_for(path: str, status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """The error body in the shape of the API the path belongs to."""
    if is_anthropic(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, code, param)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    message = clip(printable(message), MAX_MESSAGE_CHARS)
    param = None if param is None else clip(printable(param), MAX_PARAM_CHARS)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(body_for(request.url.path, exc.status, exc.message, exc.code, exc.param),
                        status_code=exc.status, headers=exc.headers)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _where(first) or None
    if first.get("type") == "invalid_text":
        param = first.get("ctx", {}).get("where")
        message = invalid_text_message(param)
    elif first.get("type") == "json_invalid":
        param = None
        message = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}."
    else:
        parts = [f"{_where(e) or 'body'}: {_reason(e)}" for e in errors[:5]]
        message = "Invalid request: " + "; ".join(parts) + "."
    return JSONResponse(body_for(request.url.path, 400, message, "invalid_request", param), status_code=400)


# The members of a union in an error's location (prompt.list[int].0): the field's path reads without them.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|[a-z-]+\[.*\])$")


def _where(error: dict) -> str:
    """The path of the field an error is about, e.g. messages.0.content."""
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p)))


def json_type(value) -> str:
    """The JSON type of a parsed value, as a message names it ("a string", "a boolean", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "a whole number"
    if isinstance(value, float):
        return "a number with a fraction or exponent"
    return {str: "a string", dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def _reason(error: dict) -> str:
    """Pydantic's message, with the JSON type that was sent when the type is wrong (never the value itself)."""
    msg = str(error.get("msg", "")).removeprefix("Value error, ")
    if str(error.get("type", "")).endswith("_type") and "input" in error:
        msg += f", not {json_type(error['input'])}"
    return msg


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return JSONResponse(body_for(request.url.path, exc.status_code, message), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


class CatchAll:
    """Pure-ASGI middleware: a failure no check foresaw still gets a 500 in the API's error shape (the traceback
    goes to the server's log), and the connection stays usable."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watching_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception as exc:
            log.exception("request %s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise
            message = (f"The server failed on this request ({type(exc).__name__}: {exc}). This is a bug in the "
                       "server; please report it with the request that caused it.")
            await JSONResponse(body_for(scope.get("path", ""), 500, message, "internal_error"),
                               status_code=500)(scope, receive, send)


def install(app) -> None:
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(CatchAll)  # the innermost middleware: inside the security checks and the request counter
