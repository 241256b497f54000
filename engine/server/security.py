"""Security by default: loopback Host check, API key, CORS, request size limits.

Pure ASGI middleware (not BaseHTTPMiddleware, which would buffer streamed answers and hide client disconnects).
From the outside in, a request meets:

1. the Host check, while the server is bound to a loopback address: only requests addressed to localhost,
   127.x.x.x or [::1] are answered (403 otherwise), so web pages cannot reach the server through DNS rebinding;
2. CORS, only when ``cors_origins`` is set: Starlette's CORSMiddleware answers preflights itself and adds the
   headers to every answer, the errors below included, so a browser page can read why it was refused;
3. the API key, when ``api_key`` is set: every route but ``GET /health`` needs ``Authorization: Bearer KEY`` or
   ``X-Api-Key: KEY`` (401 otherwise);
4. the body size: a ``Content-Length`` over ``max_body_mib`` is refused at once, a chunked body as soon as the bytes
   received pass the limit (413).

Every refusal is an error in the shape of the API its path belongs to (``errors.body_for``: OpenAI's, or
Anthropic's on /v1/messages).
"""
from __future__ import annotations

import contextvars
import hmac
import json

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from engine.config.loading import is_loopback
from engine.server.errors import body_for, shown

PUBLIC_PATHS = frozenset({"/health"})  # answered without the API key (GET and HEAD)
CORS_METHODS = ("GET", "POST", "PUT", "OPTIONS")
CORS_HEADERS = ("Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version", "Anthropic-Beta")


async def _send_error(send, status: int, message: str, code: str, headers: dict[str, str] | None = None,
                      path: str = "") -> None:
    body = json.dumps(body_for(path, status, message, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> list[bytes]:
    return [v for k, v in scope.get("headers", ()) if k.lower() == name]


def host_name(host_header: str) -> str:
    """The name in a Host header, without the port: "localhost:8080" -> "localhost", "[::1]:8080" -> "::1". A header
    that is not name[:digits] (e.g. "127.0.0.1:80@evil.com") comes back whole, so it matches no loopback name."""
    host = host_header.strip()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name if rest == "" or (rest.startswith(":") and rest[1:].isdigit()) else host
    if host.count(":") > 1:  # a bare IPv6 address (not valid in Host, but unambiguous)
        return host
    name, sep, port = host.partition(":")
    return name if not sep or port.isdigit() else host


class HostCheck:
    """Refuses requests whose Host header is not a loopback name (the server is bound to loopback)."""

    def __init__(self, app, bound: str):
        self.app, self.bound = app, bound

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        hosts = _header(scope, b"host")
        # No Host header at all (HTTP/1.0) cannot come from a browser, the only client DNS rebinding fools.
        name = host_name(hosts[0].decode("latin-1")) if hosts else "localhost"
        if len(hosts) <= 1 and is_loopback(name):
            return await self.app(scope, receive, send)
        sent = hosts[0].decode("latin-1") if len(hosts) == 1 else ", ".join(h.decode("latin-1") for h in hosts)
        message = (f"The Host header {shown(sent)} is not allowed: this server listens on {self.bound} (this computer "
                   f"only) and answers requests addressed to localhost, 127.0.0.1 or [::1], which protects it from "
                   f"DNS-rebinding attacks by web pages. Connect through http://127.0.0.1 or http://localhost; to serve "
                   f"other names, listen on them with --host and set --api-key (or NINFER_API_KEY).")
        if scope["type"] == "websocket":  # no routes use websockets; refuse before the handshake
            return await send({"type": "websocket.close", "code": 1008})
        await _send_error(send, 403, message, "host_not_allowed", path=scope.get("path", ""))


_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("cors_path", default="")


class _CORS(CORSMiddleware):
    """Starlette's CORS middleware, whose refused preflights (plain text) come in the API's error shape."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            _PATH.set(scope.get("path", ""))
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        what = bytes(response.body).decode("utf-8", "replace")  # e.g. "Disallowed CORS origin, method"
        origin = request_headers.get("origin", "")
        message = (f"The CORS preflight from origin {shown(origin)} was refused ({what}). This server allows the "
                   f"origins in --cors-origins, the methods {', '.join(CORS_METHODS)} and the headers "
                   f"{', '.join(CORS_HEADERS)}.")
        return JSONResponse(body_for(_PATH.get(), response.status_code, message, "cors_refused"),
                            status_code=response.status_code, headers={"Vary": "Origin"})


class _BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit; the gate answers 413 whatever the app does."""


class Gate:
    """The API key and the body-size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, cors: bool):
        self.app, self.max_body, self.cors = app, max_body_bytes, cors
        self.key = api_key.encode() if api_key else None

    def _key_ok(self, scope) -> bool:
        offered = [v[7:].strip() for v in _header(scope, b"authorization") if v[:7].lower() == b"bearer "]
        offered += [v.strip() for v in _header(scope, b"x-api-key")]
        ok = False
        for candidate in offered:  # compare all of them, in constant time each
            ok |= hmac.compare_digest(candidate, self.key)
        return ok

    def _exempt(self, scope) -> bool:
        method = scope.get("method", "GET")
        if method in ("GET", "HEAD") and scope["path"] in PUBLIC_PATHS:
            return True
        # A CORS preflight carries no credentials by design; CORSMiddleware answers it before it gets here, this
        # is only for one it passed on (e.g. an origin it does not allow, which it refuses itself anyway).
        return self.cors and method == "OPTIONS" and bool(_header(scope, b"access-control-request-method"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            if scope["type"] == "websocket" and self.key is not None and not self._key_ok(scope):
                return await send({"type": "websocket.close", "code": 1008})
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.key is not None and not self._exempt(scope) and not self._key_ok(scope):
            sent = bool(_header(scope, b"authorization") or _header(scope, b"x-api-key"))
            message = ("Incorrect API key provided." if sent else "Missing API key.") + (
                " This server needs its API key in the header 'Authorization: Bearer KEY' (OpenAI clients send "
                "their api_key that way) or 'X-Api-Key: KEY'; the key is the server's --api-key / NINFER_API_KEY.")
            return await _send_error(send, 401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"}, path)

        limit_mib = self.max_body // (1024 * 1024)
        too_large = (f"The request body is larger than this server's limit of {limit_mib} MiB; send a smaller "
                     f"request, or raise the limit with --max-body-mib (NINFER_MAX_BODY_MIB).")
        lengths = _header(scope, b"content-length")
        if lengths:
            try:
                length = int(lengths[0])
            except ValueError:
                return await _send_error(send, 400, "The Content-Length header is not a number: send the body's "
                                         "length in bytes, or no Content-Length (a chunked body).", "invalid_request",
                                         path=path)
            if length > self.max_body:
                return await _send_error(send, 413, too_large, "request_too_large", path=path)
            return await self.app(scope, receive, send)

        # No Content-Length (chunked): count the bytes as the app reads them.
        received, exceeded, started = 0, False, False

        async def counting_receive():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    exceeded = True
                    raise _BodyTooLarge(413, too_large)
            return message

        async def guarded_send(message):
            nonlocal started
            if exceeded:  # whatever the app answers once the limit is passed, the client gets the 413
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if exceeded and not started:
            await _send_error(send, 413, too_large, "request_too_large", path=path)


def install(app, state) -> None:
    """Adds the server's protective middleware to the app (settings are read once, here)."""
    s = state.settings
    # add_middleware puts each new layer outside the ones before it: the innermost goes first.
    app.add_middleware(Gate, api_key=s.api_key, max_body_bytes=s.max_body_mib * 1024 * 1024, cors=bool(s.cors_origins))
    if s.cors_origins:
        app.add_middleware(_CORS, allow_origins=list(s.cors_origins), allow_methods=list(CORS_METHODS),
                           allow_headers=list(CORS_HEADERS))
    if is_loopback(s.host):
        app.add_middleware(HostCheck, bound=s.host)
