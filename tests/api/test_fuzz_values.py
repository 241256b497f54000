"""Property-based fuzzing of the body layer: a rich, valid body for every route, with one value (or key) anywhere
in it replaced by a hostile one (NaN, Infinity, 1e999, a 5,000-digit integer, lone surrogates, control characters,
a 1 MiB string). No answer is a 500, every refusal has its API's shape, nothing is logged with a traceback, and no
sequence is left running. (test_schemathesis fuzzes from the OpenAPI schema; this reaches the fields it leaves
free-form: message contents, tool schemas, metadata.)"""
import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from starlette.testclient import TestClient

from tests.api.test_schemathesis import HOST, _api_error_shape, _engine, app

EXAMPLES = 30  # per route, beside the sweep of every place: ~150 requests in process
MARK = "\u2063HOSTILE\u2063"
HOSTILE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000, '"\\ud800"', '"x\\udfff"',
           '"\\u0000\\u0007\\u001b[2J\\r\\nX-Injected: 1"', json.dumps("x" * 2**20), '"' + "\\u0000" * 4096 + '"',
           "[" * 64 + "]" * 64, "-0", "1e-400", '""', "null", "{}", "[]", "true"]
NASTY = json.dumps("web_\u641c\u7d22\u0000\u001b[2J\r\nX-Injected: 1")  # lone surrogates are in HOSTILE: refused at the door
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "description": "The city.", "maxLength": 64}},
                                             "required": ["city"]}}}
BODIES = {
    "/v1/chat/completions": {"model": "scripted", "max_tokens": 8, "temperature": 0.5, "seed": 1, "user": "u",
                             "stop": ["\n\n"], "logit_bias": {"11": 1}, "tools": [TOOL], "tool_choice": "auto",
                             "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "o", "schema": {"type": "object", "properties": {"a": {"type": "number"}}}}},
                             "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                                          {"role": "assistant", "content": None, "tool_calls": [{
                                              "id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                                          {"role": "tool", "tool_call_id": "c1", "content": "Sunny."}]},
    "/v1/completions": {"model": "scripted", "prompt": ["Once", "upon"], "max_tokens": 8, "suffix": None,
                        "stop": "\n", "logit_bias": {"11": -1}, "user": "u", "echo": True, "logprobs": 2},
    "/v1/responses": {"model": "scripted", "instructions": "Be brief.", "max_output_tokens": 8,
                      "metadata": {"k": "v"}, "user": "u",
                      "tools": [{"type": "function", "name": "f", "description": "d",
                                 "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                                {"type": "web_search"}],
                      "text": {"format": {"type": "json_schema", "name": "o",
                                          "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}},
                      "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
                                {"type": "function_call_output", "call_id": "c1", "output": "2"}]},
    "/v1/messages": {"model": "scripted", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
                     "stop_sequences": ["\n\n"], "metadata": {"user_id": "u"}, "temperature": 0.5,
                     "tools": [{"name": "get_weather", "description": "d", "input_schema": {
                         "type": "object", "properties": {"city": {"type": "string"}}}}],
                     "thinking": {"type": "enabled", "budget_tokens": 1024},
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                                     "name": "get_weather", "input": {"city": "Oslo"}}]},
                                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                "content": "Sunny."}]}]},
}
BODIES["/v1/messages/count_tokens"] = {k: v for k, v in BODIES["/v1/messages"].items() if k != "max_tokens"}


def _places(value, path=()):
    """Every value's path in a body, and every key's (as (path, KEY))."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield path + ((k, "KEY"),)
            yield from _places(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _places(v, path + (i,))


def _with_mark(value, path):
    """A copy of value with the value (or key) at path replaced by MARK."""
    if not path:
        return MARK
    head, rest = path[0], path[1:]
    if isinstance(head, tuple):  # a key
        return {(MARK if k == head[0] else k): v for k, v in value.items()}
    if isinstance(value, dict):
        return {k: (_with_mark(v, rest) if k == head else v) for k, v in value.items()}
    return [_with_mark(v, rest) if i == head else v for i, v in enumerate(value)]


def _hostile_body(path: str, where: int, hostile: str) -> tuple[bytes, str]:
    base = BODIES[path]
    places = [p for p in _places(base) if p]
    place = places[where % len(places)]
    text = json.dumps(_with_mark(base, place))
    if isinstance(place[-1], tuple) and not hostile.startswith('"'):
        hostile = json.dumps(hostile)  # a key is a string
    return text.replace(json.dumps(MARK), hostile, 1).encode(), f"{place} = {hostile[:60]}"


def _refuse_constant(name: str):
    raise AssertionError(f"the answer carries a bare {name}")


def _check(client, path: str, body: bytes, stream: bool, seen: str, caplog) -> None:
    if stream and path != "/v1/messages/count_tokens":
        body = body[:-1] + b', "stream": true}'
    r = client.post(path, content=body, headers={**HOST, "Content-Type": "application/json"})
    assert r.status_code < 500, (seen, r.text[:300])
    if r.status_code >= 400:
        assert _api_error_shape(path, r.json()), (seen, r.text[:300])
    else:  # an answer is strict JSON: no NaN or Infinity echoed back
        for part in [r.text] if not stream else [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]:
            json.loads(part, parse_constant=_refuse_constant)
    assert not any(k.lower().startswith("x-injected") for k in r.headers), seen
    assert _engine.stats()["running"] == 0, seen
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert not tracebacks, (seen, tracebacks[0].getMessage())


@pytest.mark.parametrize("path", list(BODIES))
def test_a_hostile_string_in_every_place_is_never_a_server_error(path, caplog):
    """Each value and each key of the body in turn (streamed and not, alternately) replaced by a string that breaks
    what trusts text: non-Latin-1 letters (no HTTP header carries them), NUL, ESC, and a CR/LF header injection."""
    caplog.set_level(logging.WARNING)
    places = [p for p in _places(BODIES[path]) if p]
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as client:
        for i in range(len(places)):
            body, seen = _hostile_body(path, i, NASTY)
            _check(client, path, body, i % 2 == 1, seen, caplog)


@pytest.mark.parametrize("path", list(BODIES))
def test_a_hostile_value_anywhere_is_never_a_server_error(path, caplog):
    caplog.set_level(logging.WARNING)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(where=st.integers(0, 10_000), hostile=st.sampled_from(HOSTILE), stream=st.booleans())
    def check(where, hostile, stream):
        body, seen = _hostile_body(path, where, hostile)
        with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as client:
            _check(client, path, body, stream, seen, caplog)

    check()


def test_the_fuzzed_bodies_are_valid_before_they_are_made_hostile():
    with TestClient(app, base_url="http://localhost") as client:
        for path, body in BODIES.items():
            r = client.post(path, json=body, headers=HOST)
            assert r.status_code == 200, (path, r.text[:300])
