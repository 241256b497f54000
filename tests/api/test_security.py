"""Security by default, over real HTTP: loopback Host check, API key, body-size limit, CORS, request bounds and the
startup check that refuses to expose the API to the network without a key."""
from contextlib import contextmanager

import httpx
import openai
import pytest

from engine.config.loading import ConfigError, format_settings, is_loopback, load_settings, settings_from_mapping
from engine.server.security import host_name
from engine.server.state import ServerState
from tests.api.conftest import RunningServer

MODEL = "smollm2-135m-instruct"
KEY = "sk-test-Secret_123"
HELLO = [{"role": "user", "content": "Say hello."}]


@contextmanager
def serving(engine=None, **values):
    """A server on a free loopback port with these settings; with engine=None the model is 'still loading', which is
    enough for everything the middleware answers before a route runs."""
    state = ServerState(settings_from_mapping(values, "test"), [MODEL])
    state.loaded = engine
    with RunningServer(state) as running, httpx.Client(base_url=running.base_url, timeout=60) as client:
        yield running, client


def assert_error(r: httpx.Response, status: int, code: str, kind: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["type"]) == (code, kind)
    return err["message"]


# ---------------------------------------------------------------- Host check (DNS rebinding)

@pytest.fixture(scope="module")
def loopback():
    with serving() as pair:
        yield pair


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:{port}", "localhost.evil.example.com",
                                  "127.0.0.1.nip.io:{port}", "10.0.0.1:{port}", "[::2]:{port}"])
def test_foreign_host_header_is_refused_on_loopback(loopback, host):
    running, client = loopback
    r = client.get("/v1/models", headers={"Host": host.format(port=running.port)})
    message = assert_error(r, 403, "host_not_allowed", "permission_error")
    assert "DNS-rebinding" in message and "--host" in message and "--api-key" in message
    # even the health check: a rebinding page must learn nothing
    assert client.get("/health", headers={"Host": host.format(port=running.port)}).status_code == 403


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST", "127.1.2.3",
                                  "localhost.:{port}"])
def test_loopback_host_header_is_served(loopback, host):
    running, client = loopback
    r = client.get("/v1/models", headers={"Host": host.format(port=running.port)})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_no_host_check_when_bound_to_the_network():
    with serving(host="0.0.0.0", api_key=KEY) as (_, client):
        r = client.get("/v1/models", headers={"Host": "my-server.lan:8080", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
    with serving(host="0.0.0.0", insecure_no_auth=True) as (_, client):
        assert client.get("/v1/models", headers={"Host": "my-server.lan"}).status_code == 200


@pytest.mark.parametrize("header, name", [("localhost:8080", "localhost"), ("[::1]:8080", "::1"), ("[::1]", "::1"),
                                          ("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("a.b:1", "a.b")])
def test_host_name(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("host, loop", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
                                        ("localhost", True), ("LocalHost", True), ("::ffff:127.0.0.1", True),
                                        ("0.0.0.0", False), ("::", False), ("192.168.1.5", False),
                                        ("localhost.evil.com", False), ("128.0.0.1", False), ("my-pc", False)])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


# ---------------------------------------------------------------- API key

@pytest.fixture(scope="module")
def keyed():
    with serving(api_key=KEY) as pair:
        yield pair


@pytest.mark.parametrize("headers, word", [({}, "Missing"), ({"Authorization": "Bearer wrong"}, "Incorrect"),
                                           ({"X-Api-Key": "wrong"}, "Incorrect"), ({"Authorization": KEY}, "Incorrect"),
                                           ({"Authorization": f"Basic {KEY}"}, "Incorrect"),
                                           ({"Authorization": f"Bearer {KEY}x"}, "Incorrect")])
def test_missing_or_wrong_key_is_401(keyed, headers, word):
    _, client = keyed
    for r in (client.get("/v1/models", headers=headers),
              client.post("/v1/chat/completions", headers=headers, json={"model": MODEL, "messages": HELLO}),
              client.get("/docs", headers=headers), client.get("/nowhere", headers=headers)):
        message = assert_error(r, 401, "invalid_api_key", "authentication_error")
        assert message.startswith(word) and "Authorization: Bearer" in message and "X-Api-Key" in message
        assert r.headers["www-authenticate"] == "Bearer"
        assert "wrong" not in message and KEY not in message


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"},
                                     {"X-Api-Key": KEY}, {"Authorization": "Bearer wrong", "X-Api-Key": KEY}])
def test_right_key_is_accepted(keyed, headers):
    _, client = keyed
    r = client.get("/v1/models", headers=headers)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    # past the gate: the route itself answers (the model is still loading here)
    r = client.post("/v1/chat/completions", headers=headers, json={"model": MODEL, "messages": HELLO})
    assert_error(r, 503, "model_loading", "service_unavailable")


def test_health_is_public(keyed):
    _, client = keyed
    assert client.get("/health").status_code == 503  # loading, not 401
    assert client.head("/health").status_code != 401
    assert client.post("/health").status_code == 401  # only reading it is public


def test_openai_sdk_with_api_key_end_to_end(default_engine):
    with serving(default_engine, api_key=KEY) as (running, _):
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8)
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        bad = openai.OpenAI(base_url=running.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


# ---------------------------------------------------------------- body size

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def small_body():
    with serving(max_body_mib=1) as pair:
        yield pair


def padded_json(size: int) -> bytes:
    """A valid chat request of exactly ``size`` bytes."""
    head, tail = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "pad": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def test_content_length_over_the_limit_is_413(small_body):
    _, client = small_body
    r = client.post("/v1/chat/completions", content=padded_json(MIB + 1), headers={"Content-Type": "application/json"})
    message = assert_error(r, 413, "request_too_large", "invalid_request_error")
    assert "1 MiB" in message and "--max-body-mib" in message
    # the connection stays usable, and a body at the limit gets through to the route
    r = client.post("/v1/chat/completions", content=padded_json(MIB), headers={"Content-Type": "application/json"})
    assert_error(r, 503, "model_loading", "service_unavailable")


def test_chunked_body_over_the_limit_is_413(small_body):
    _, client = small_body

    def chunks(total, size=64 * 1024):
        data = padded_json(total)
        for i in range(0, total, size):
            yield data[i:i + size]

    r = client.post("/v1/chat/completions", content=chunks(MIB + 64 * 1024), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert_error(r, 413, "request_too_large", "invalid_request_error")
    r = client.post("/v1/chat/completions", content=chunks(MIB - 1), headers={"Content-Type": "application/json"})
    assert_error(r, 503, "model_loading", "service_unavailable")
    r = client.post("/v1/chat/completions", content=iter([b'{"model": "x", ', b'"messages": ']),
                    headers={"Content-Type": "application/json"})
    assert_error(r, 400, "invalid_request", "invalid_request_error")  # a small broken body is still parsed


def test_key_is_checked_before_the_body():
    with serving(api_key=KEY, max_body_mib=1) as (_, client):
        r = client.post("/v1/chat/completions", content=padded_json(2 * MIB))
        assert_error(r, 401, "invalid_api_key", "authentication_error")
        r = client.post("/v1/chat/completions", content=padded_json(2 * MIB), headers={"X-Api-Key": KEY})
        assert_error(r, 413, "request_too_large", "invalid_request_error")


# ---------------------------------------------------------------- CORS

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def test_no_cors_headers_by_default(loopback):
    _, client = loopback
    r = client.get("/v1/models", headers={"Origin": "http://a.test"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = client.options("/v1/chat/completions", headers={"Origin": "http://a.test", **PREFLIGHT})
    assert not any(h.startswith("access-control-") for h in r.headers)


def test_cors_allows_exactly_the_listed_origins():
    with serving(api_key=KEY, cors_origins=["http://a.test"]) as (_, client):
        r = client.options("/v1/chat/completions", headers={"Origin": "http://a.test", **PREFLIGHT})
        assert r.status_code == 200  # the preflight needs no key: browsers never send one with it
        assert r.headers["access-control-allow-origin"] == "http://a.test"
        allowed = r.headers["access-control-allow-headers"].lower()
        assert {"authorization", "content-type", "x-api-key"} <= {h.strip() for h in allowed.split(",")}
        assert "POST" in r.headers["access-control-allow-methods"]
        r = client.options("/v1/chat/completions", headers={"Origin": "http://b.test", **PREFLIGHT})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = client.get("/v1/models", headers={"Origin": "http://a.test", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.test"
        r = client.get("/v1/models", headers={"Origin": "http://b.test", "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        # a refusal is readable by the allowed page, so it can tell the user the key is wrong
        r = client.get("/v1/models", headers={"Origin": "http://a.test"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://a.test"


def test_cors_star_allows_every_origin():
    with serving(cors_origins=["*"]) as (_, client):
        r = client.options("/v1/chat/completions", headers={"Origin": "http://c.test", **PREFLIGHT})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_cors_does_not_bypass_the_host_check():
    with serving(cors_origins=["*"]) as (_, client):
        r = client.options("/v1/chat/completions", headers={"Origin": "http://evil.example.com",
                                                             "Host": "evil.example.com", **PREFLIGHT})
        assert_error(r, 403, "host_not_allowed", "permission_error")


# ---------------------------------------------------------------- request content bounds

@pytest.mark.parametrize("extra, param", [
    ({"stop": ["s"] * 17}, "stop"), ({"stop": ["x" * 513]}, "stop"), ({"stop": "x" * 513}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
    ({"messages": HELLO * 4097}, "messages"), ({"n": 9}, "n"), ({"top_logprobs": 21}, "top_logprobs"),
])
def test_request_bounds_are_400(loopback, extra, param):
    _, client = loopback
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **extra})
    assert_error(r, 400, "invalid_request", "invalid_request_error")
    assert r.json()["error"]["param"] == param


def test_request_at_the_bounds_runs(default_engine):
    with serving(default_engine) as (_, client):
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0,
                "stop": [f"stop{i}" + "x" * 500 for i in range(16)]}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0


# ---------------------------------------------------------------- startup check and the new settings

def test_network_host_without_key_is_refused():
    with pytest.raises(ConfigError) as info:
        load_settings(["--host", "0.0.0.0"], {})
    [problem] = info.value.problems
    assert problem.startswith("[flag:--host] --host 0.0.0.0 exposes the API to the network without a key")
    assert "--api-key" in problem and "NINFER_API_KEY" in problem and "--insecure-no-auth" in problem
    [problem] = pytest.raises(ConfigError, load_settings, [], {"NINFER_HOST": "::"}).value.problems
    assert problem.startswith("[env:NINFER_HOST] --host :: exposes")


@pytest.mark.parametrize("argv, env", [
    (["--host", "0.0.0.0", "--api-key", KEY], {}),
    (["--host", "0.0.0.0"], {"NINFER_API_KEY": KEY}),
    (["--host", "0.0.0.0", "--insecure-no-auth"], {}),
    (["--host", "192.168.1.5"], {"NINFER_INSECURE_NO_AUTH": "1"}),
    (["--host", "localhost"], {}), (["--host", "::1"], {}), (["--host", "127.0.0.2"], {}),
])
def test_network_host_with_key_or_insecure_flag_loads(argv, env):
    settings, warnings = load_settings(argv, env)
    assert warnings == [] and settings.host == argv[1]


def test_new_settings_defaults_and_sources():
    settings, _ = load_settings(["--cors-origins", "http://a.test", "--cors-origins", "http://b.test:8000",
                                 "--max-queue", "0"], {"NINFER_MAX_BODY_MIB": "2"})
    assert settings.cors_origins == ["http://a.test", "http://b.test:8000"] and settings.max_queue == 0
    assert (settings.max_body_mib, settings.source("max_body_mib")) == (2, "env:NINFER_MAX_BODY_MIB")
    defaults, _ = load_settings([], {})
    assert (defaults.api_key, defaults.insecure_no_auth, defaults.cors_origins, defaults.max_queue,
            defaults.max_body_mib) == (None, False, [], 64, 16)


@pytest.mark.parametrize("argv, needle", [
    (["--max-body-mib", "0"], "--max-body-mib 0: must be at least 1"),
    (["--max-queue", "-1"], "--max-queue -1: must be at least 0"),
    (["--cors-origins", "http://a.test/"], "is not an origin"),
    (["--cors-origins", "a.test"], "is not an origin"),
])
def test_new_settings_are_validated(argv, needle):
    with pytest.raises(ConfigError) as info:
        load_settings(argv, {})
    [problem] = info.value.problems
    assert needle in problem


def test_api_key_is_never_shown():
    settings, _ = load_settings(["--api-key", KEY], {})
    text = format_settings(settings)
    assert KEY not in text and "(hidden)" in text
    with pytest.raises(ConfigError) as info:
        load_settings([], {"NINFER_API_KEY": "has a space"})
    [problem] = info.value.problems
    assert "has a space" not in problem and "[env:NINFER_API_KEY] --api-key (hidden): must be printable ASCII" in problem
