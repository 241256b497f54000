"""Requests uvicorn's HTTP parser refuses before the app sees them get the API's JSON error shape with status 400, from
a real `ninfer-serve` process, over a raw socket (no HTTP client would send these)."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.api.conftest import free_port

UNREADABLE = {
    "content-length not a number": b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   b"Content-Type: application/json\r\nContent-Length: abc\r\n\r\n{}",
    "content-length with a suffix": b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 12x\r\n\r\n",
    "a header line without a colon": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nnot a header\r\n\r\n",
    "a request line that is not HTTP": b"HELLO THERE\r\n\r\n",
}


@pytest.fixture(scope="module")
def serve():
    """`ninfer-serve` on a free port, as the command starts it; it answers (503 /health) while the model loads."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"ninfer-serve did not start: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends bytes as they are and reads the answer until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_a_request_the_http_parser_refuses_gets_the_api_error_shape(serve, case):
    status, headers, body = raw_exchange(serve, UNREADABLE[case])
    assert status == 400
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_http", None)
    assert "not valid HTTP" in error["message"] and "Content-Length" in error["message"]


def test_the_server_still_answers_after_refusing_one(serve):
    raw_exchange(serve, UNREADABLE["content-length not a number"])
    status, _, body = raw_exchange(serve, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status in (200, 503) and json.loads(body)["status"] in ("ok", "loading")
