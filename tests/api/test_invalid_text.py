"""Text that is not valid Unicode (a lone surrogate, which a JSON string escape can hold) gets a 400 naming the
field that holds it, on every route, never a 500."""
import httpx
import pytest

from tests.api.scripted import scripted_server

HELLO = [{"role": "user", "content": "Say hello."}]
BAD = "\\ud800"  # as written in the JSON text: the escape of a lone surrogate


def raw(client, path: str, body: str, method: str = "POST") -> httpx.Response:
    """Sends the JSON text as written (a JSON encoder would refuse the surrogate before it left the client)."""
    return client.request(method, path, content=body.encode(), headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def scripted(default_engine):
    with scripted_server(default_engine) as running, httpx.Client(base_url=running.base_url, timeout=30) as client:
        running.engine.script = "Hello!"
        yield running.engine, client


CASES = [
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": "a%sb"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"model": "scripted%s", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/v1/chat/completions", '{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], '
                             '"logit_bias": {"1%s": 5}}', "logit_bias.1\\ud800"),
    ("/v1/completions", '{"model": "scripted", "prompt": "%s"}', "prompt"),
    ("/v1/completions", '{"model": "scripted", "prompt": ["ok", "%s"]}', "prompt.1"),
    ("/v1/responses", '{"model": "scripted", "input": "%s"}', "input"),
    ("/v1/responses", '{"model": "scripted", "input": "hi", "instructions": "%s"}', "instructions"),
    ("/v1/responses", '{"model": "scripted", "input": [{"role": "user", "content": "%s"}]}', "input.0.content"),
]


@pytest.mark.parametrize("path,body,param", CASES)
def test_a_lone_surrogate_is_a_400_naming_the_field(scripted, path, body, param):
    engine, client = scripted
    r = raw(client, path, body % BAD)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "not valid Unicode" in err["message"] and "UTF-8" in err["message"]
    # and the same request with valid text is served
    assert raw(client, path, body % ("" if param in ("model", "logit_bias.1\\ud800") else "x")).status_code == 200


def test_anthropic_route_answers_in_its_own_shape(scripted):
    _, client = scripted
    r = raw(client, "/v1/messages", '{"model": "scripted", "max_tokens": 4, "system": "%s", '
                                    '"messages": [{"role": "user", "content": "hi"}]}' % BAD)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("system holds text that is not valid Unicode")


def test_settings_put_names_the_setting(scripted):
    _, client = scripted
    r = raw(client, "/ninfer/v1/settings", '{"mode": "%s"}' % BAD, method="PUT")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "mode" and "not valid Unicode" in err["message"]
    assert client.get("/ninfer/v1/settings").status_code == 200
