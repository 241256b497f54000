"""Hostile bodies at the door: list-shaped bodies of millions of items are refused before they are parsed, while
/health keeps answering within 100 ms; integer literals too long to read and non-finite numbers (NaN, Infinity,
1e999) are a 400 on every route, never a 500 or a number echoed back."""
import json
import time

import httpx
import pytest

from engine.server.bodyjson import MAX_VALUES, count_values
from tests.api.conftest import post_while_polling_health, wait_idle

# /health must not wait on a body more than 100 ms. The poller runs in this process beside the server (the
# interpreter is shared, as it is for a server in the app), so its own scheduling on the 2-core test machine, shared
# with other test runs, adds up to ~50 ms now and then (measured idle: 5-40 ms slowest of ~100 polls).
HEALTH_BOUND = 0.100
SCHEDULING_NOISE = 0.050

ROUTES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
          "/v1/completions": {"prompt": "hi"},
          "/v1/responses": {"input": "hi"},
          "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
          "/v1/messages/count_tokens": {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}}


def _list_body(item: str, count: int) -> bytes:
    return ('{"model":"scripted","prompt":[' + ",".join([item] * count) + "]}").encode()


LARGE = {"3.8M prompts": lambda: _list_body('"a"', 3_800_000),
         "3.6M token-id prompts": lambda: _list_body("[1]", 3_600_000),
         "one prompt of 7.8M ids": lambda: _list_body("1", 7_800_000)}


@pytest.mark.parametrize("case", list(LARGE))
def test_a_list_of_millions_is_refused_at_once_and_health_stays_within_100_ms(scripted, case):
    body = LARGE[case]()
    assert len(body) > 9 * 2**20
    r, took, slowest = post_while_polling_health(scripted.base_url, "/v1/completions", body)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == "too_many_values"
    assert took < 5.0, f"the refusal took {took:.1f} s"
    assert slowest < HEALTH_BOUND + SCHEDULING_NOISE, f"/health took {slowest * 1000:.0f} ms while the body was read"


def test_the_largest_body_a_request_needs_is_read_without_holding_up_health(scripted):
    """A prompt of 2**18 token ids (a large model's whole context) is parsed and validated, then refused for this
    model's context, with /health answered meanwhile."""
    body = _list_body("1", 2**18)
    r, _, slowest = post_while_polling_health(scripted.base_url, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert slowest < HEALTH_BOUND + SCHEDULING_NOISE, f"/health took {slowest * 1000:.0f} ms while the body was read"


def test_more_prompts_than_a_request_may_hold_are_counted_before_any_is_looked_at(scripted):
    t = time.perf_counter()
    with httpx.Client(base_url=scripted.base_url, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "scripted", "prompt": ["a"] * 100_000})
    assert time.perf_counter() - t < 3.0
    assert r.status_code == 400 and "at most 4096 prompts" in r.json()["error"]["message"], r.text[:300]


def test_more_prompts_than_the_server_runs_are_refused_before_any_is_encoded(http, default_engine):
    t = time.perf_counter()
    r = http.post("/v1/completions", json={"model": "smol", "prompt": ["hello " * 300] * 4000, "max_tokens": 1})
    assert time.perf_counter() - t < 3.0
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences", r.text[:300]
    assert wait_idle(default_engine.engine)["running"] == 0


def test_values_are_counted_outside_strings():
    assert count_values(b'{"a": "x, [y], {z}", "b": [1, 2, 3]}') == (5, 2)
    assert count_values(b'{"a": "say \\"x, y\\" \\\\", "b": [1]}') == (3, 2)
    assert count_values(json.dumps({"t": "," * 100_000}).encode()) == (1, 1)
    many = ("[" + ",".join(["1"] * (MAX_VALUES + 10)) + "]").encode()
    assert count_values(many)[0] > MAX_VALUES


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("where", ["max_tokens", "ignored"])
def test_an_integer_of_5000_digits_is_a_400_on_every_route(scripted, path, where):
    body = json.dumps({"model": "scripted", **ROUTES[path]})[:-1] + f', "{where}": {"9" * 5000}}}'
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "4,300 digits" in message, message


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_number_is_a_400_on_every_route(scripted, path, number):
    body = json.dumps({"model": "scripted", **ROUTES[path]})[:-1] + f', "temperature": {number}}}'
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert "finite numbers only" in r.json()["error"]["message"]


RESPONSES_FIELDS = {
    "metadata": {"metadata": {"score": "NaN"}},
    "tool parameters": {"tools": [{"type": "function", "name": "f",
                                   "parameters": {"type": "object", "properties": {"x": {"maximum": "Infinity"}}}}]},
    "text.format": {"text": {"format": {"type": "json_schema", "name": "o",
                                        "schema": {"type": "number", "minimum": "-Infinity"}}}},
}


@pytest.mark.parametrize("field", list(RESPONSES_FIELDS))
@pytest.mark.parametrize("stream", [False, True])
def test_non_finite_numbers_in_responses_fields_are_refused_not_echoed(scripted, field, stream):
    scripted.engine.script = "Hello"
    before = len(scripted.engine.prompts)
    body = json.dumps({"model": "scripted", "input": "hi", "stream": stream, **RESPONSES_FIELDS[field]})
    body = body.replace('"NaN"', "NaN").replace('"Infinity"', "Infinity").replace('"-Infinity"', "-Infinity")
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post("/v1/responses", content=body.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == "invalid_number"
    assert len(scripted.engine.prompts) == before, "the request reached the engine"
    assert wait_idle(scripted.engine)["running"] == 0


HOSTED_NAMES = {"non-Latin-1": "web_search_\u641c\u7d22", "CR/LF": "web_search\r\nX-Injected: 1",
                "1 MiB": "w" * 2**20, "not a string": 7}


def _hosted(path: str, name) -> dict:
    if path == "/v1/messages":
        return {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": name}]}
    return {"input": "hi", "tools": [{"type": name}]}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("case", list(HOSTED_NAMES))
@pytest.mark.parametrize("stream", [False, True])
def test_a_hosted_tool_named_with_text_no_header_can_carry_is_a_400_before_the_engine(scripted, path, case, stream):
    scripted.engine.script = "Hello"
    before = len(scripted.engine.prompts)
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post(path, json={"model": "scripted", "stream": stream, **_hosted(path, HOSTED_NAMES[case])})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert "tools[0]" in error["message"], error
    assert len(r.text) < 4096 and not any(k.lower().startswith("x-injected") for k in r.headers)
    assert len(scripted.engine.prompts) == before, "the request reached the engine"
    assert wait_idle(scripted.engine)["running"] == 0


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_many_hosted_tools_are_named_in_a_header_of_bounded_size(scripted, path):
    scripted.engine.script = "Hello"
    body = _hosted(path, "x")
    body["tools"] = [{**body["tools"][0], ("name" if path == "/v1/messages" else "type"): f"hosted_{i:03d}_" + "t" * 50}
                     for i in range(100)]
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        r = c.post(path, json={"model": "scripted", **body})
    assert r.status_code == 200, r.text[:300]
    header = r.headers["x-ninfer-omitted-tools"]
    names = header.split(", ")
    assert names[:16] == [f"hosted_{i:03d}_" + "t" * 50 for i in range(16)] and names[16] == "and 84 more"
    assert len(header) < 1200


@pytest.mark.parametrize("body, code", [(b'{"temperature": NaN}', "invalid_number"),
                                        (b'{"top_k": ' + b"9" * 5000 + b"}", "invalid_number"),
                                        (b'{"stop": [' + b",".join([b'"a"'] * 3_000_000) + b"]}", "too_many_values")])
def test_the_settings_route_reads_its_body_with_the_same_bounds(scripted, body, code):
    r, took, slowest = post_while_polling_health(scripted.base_url, "/ninfer/v1/settings", body, method="PUT")
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text[:300]
    assert took < 5.0 and slowest < HEALTH_BOUND + SCHEDULING_NOISE, (took, slowest)
