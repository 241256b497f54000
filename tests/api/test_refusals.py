"""Requests a strict server refuses get a 400 in the API's error shape before anything is admitted: schemas whose
grammar cannot start (a required recursion), values of the wrong JSON type, numbers beyond their bounds, and error
messages that echo a huge value only in part."""
import json

import httpx
import pytest

HELLO = [{"role": "user", "content": "Say hello."}]
RECURSIVE = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}


@pytest.fixture
def client(scripted):
    scripted.engine.script = "Hello."
    scripted.engine.prompts.clear()
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        yield c


def openai_error(r, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


RECURSIVE_REQUESTS = {
    "chat response_format": ("/v1/chat/completions", {"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "tree", "schema": RECURSIVE}}}, "response_format"),
    "responses text.format": ("/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "tree", "schema": RECURSIVE}}}, "text.format"),
    "forced tool parameters": ("/v1/chat/completions", {"messages": HELLO, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "grow", "parameters": RECURSIVE}}]}, "tools"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(RECURSIVE_REQUESTS))
def test_a_required_recursion_is_refused_before_the_request_is_admitted(client, scripted, case, stream):
    path, body, param = RECURSIVE_REQUESTS[case]
    r = client.post(path, json={"model": "scripted", "stream": stream, **body})
    message = openai_error(r, param)
    assert "never ends" in message and "optional" in message and "<state>" not in message
    assert not scripted.engine.prompts  # nothing was submitted


def test_a_recursion_with_an_end_is_still_enforced(client, scripted):
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    r = client.post("/v1/chat/completions", json={"model": "scripted", "messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}})
    assert r.status_code == 200, r.text
    assert scripted.engine.params[-1].constraint is not None


def test_a_recursive_tool_under_anthropic_any_is_a_400_in_anthropic_shape(client):
    r = client.post("/v1/messages", json={"model": "scripted", "max_tokens": 8, "messages": HELLO,
                                          "tool_choice": {"type": "any"},
                                          "tools": [{"name": "grow", "input_schema": RECURSIVE}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "never ends" in r.json()["error"]["message"]
