"""Edges of the security layer: HEAD on the health check, Host headers that only look local, IPv4 shorthand for
loopback, and a refused CORS preflight in the API's error shape."""
import pytest

from engine.config import is_loopback, load_settings
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

