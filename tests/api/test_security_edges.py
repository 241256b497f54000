"""Edges of the security layer: HEAD on the health check, Host headers that only look local, IPv4 shorthand for
loopback, and a refused CORS preflight in the API's error shape."""
import pytest

from engine.config.loading import is_loopback, load_settings
from engine.server.security import host_name
from tests.api.test_security import PREFLIGHT, assert_error, serving


def test_head_health_answers_like_get():
    with serving() as (_, client):  # loading
        assert client.head("/health").status_code == client.get("/health").status_code == 503
    with serving(object()) as (_, client):  # loaded
        r = client.head("/health")
        assert r.status_code == 200 and r.content == b""
        assert r.headers["content-type"] == client.get("/health").headers["content-type"]


@pytest.mark.parametrize("host", ["127.0.0.1:80@evil.com", "127.0.0.1:{port}@evil.com", "localhost:x.evil.com",
                                  "[::1]:80@evil.com", "[::1]evil.com"])
def test_a_host_that_only_starts_like_loopback_is_refused(host):
    with serving() as (running, client):
        r = client.get("/v1/models", headers={"Host": host.format(port=running.port)})
        assert_error(r, 403, "host_not_allowed", "permission_error")
    assert host_name(host) == host  # not cut down to a loopback name


@pytest.mark.parametrize("host", ["127.1", "127.0.1", "0x7f.1", "2130706433"])
def test_ipv4_shorthand_for_loopback_is_loopback(host):
    assert is_loopback(host)
    settings, _ = load_settings(["--host", host], {})  # no key needed: this computer only
    assert settings.host == host


@pytest.mark.parametrize("host", ["10.1", "1", "0x0a.1", "127.1.evil", "1e1"])
def test_other_shorthand_is_not_loopback(host):
    assert not is_loopback(host)


def test_a_refused_cors_preflight_is_in_the_api_shape():
    with serving(cors_origins=["http://a.test"]) as (_, client):
        r = client.options("/v1/chat/completions", headers={"Origin": "http://b.test", **PREFLIGHT})
        message = assert_error(r, 400, "cors_refused", "invalid_request_error")
        assert "http://b.test" in message and "--cors-origins" in message and "access-control-allow-origin" not in r.headers
        r = client.options("/v1/messages", headers={"Origin": "http://b.test", **PREFLIGHT})
        assert r.status_code == 400 and r.json()["type"] == "error" and "--cors-origins" in r.json()["error"]["message"]



def _asgi_post(app, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, dict]:
    """Calls the app directly, as an ASGI server that passes a request on unchecked would."""
    import asyncio
    import json

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"localhost"), *headers], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), json.loads(body)


def test_a_content_length_that_is_not_a_number_is_refused_in_the_api_shape():
    # behind ninfer-serve uvicorn's parser refuses such a request first, in the API's shape
    # (engine/server/protocol.py, tests/api/test_unreadable_requests.py); this is the app's own answer, for a
    # server that passes the request on.
    from engine.server.app import create_app
    from engine.server.state import ServerState

    settings, _ = load_settings([], {})
    app = create_app(ServerState(settings, ["m"]))
    status, headers, body = _asgi_post(app, "/v1/chat/completions", [(b"content-length", b"abc")])
    assert status == 400 and headers[b"content-type"] == b"application/json"
    assert body["error"]["code"] == "invalid_request" and "Content-Length" in body["error"]["message"]
    status, _, body = _asgi_post(app, "/v1/messages", [(b"content-length", b"12x")])
    assert status == 400 and body["type"] == "error" and "Content-Length" in body["error"]["message"]
