"""The HTTP protocol the server runs under uvicorn: a request uvicorn's own parser refuses before the app sees it (a
Content-Length that is not a number, a malformed request line or header) gets its 400 in the API's error shape
(engine/server/errors.py) instead of uvicorn's plain text. Pass it as uvicorn.Config(http=APIErrorsProtocol).

The parser fails before the request's path is known, so the answer takes the OpenAI shape."""
from __future__ import annotations

import json
import sys

from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools' protocol where it is installed, else h11's

from engine.server.errors import clip, error_body


def unreadable_request_body(reason: str) -> bytes:
    """The JSON body of the 400 for a request the HTTP parser could not read; `reason` is the parser's."""
    message = (f"The request is not valid HTTP/1.1 ({clip(reason)}), so the server could not read it. Check the "
               "request line and the headers: a Content-Length must be a whole number of bytes.")
    return json.dumps(error_body(400, message, "invalid_http")).encode()


class APIErrorsProtocol(AutoHTTPProtocol):
    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn, inside the handler of the parser's exception, with its own generic message."""
        error = sys.exc_info()[1]
        body = unreadable_request_body(str(error) if error is not None and str(error) else msg)
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
