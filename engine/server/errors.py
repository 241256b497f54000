"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}; on the Anthropic routes
(/v1/messages...) in Anthropic's: {"type": "error", "error": {"type", "message"}}, with the same statuses."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def anthropic_error_body(status: int, message: str) -> dict:
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
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(body_for(request.url.path, exc.status, exc.message, exc.code, exc.param),
                        status_code=exc.status, headers=exc.headers)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        param = None
        message = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}."
    else:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                 for e in errors[:5]]
        message = "Invalid request: " + "; ".join(parts) + "."
    return JSONResponse(body_for(request.url.path, 400, message, "invalid_request", param), status_code=400)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return JSONResponse(body_for(request.url.path, exc.status_code, message), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def install(app) -> None:
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
